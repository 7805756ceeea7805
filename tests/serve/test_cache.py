"""The batch KV cache keeps room for the columns to come: a decoding step writes its column into the room (no copy of
the cache), and the logits of every pass, through joins and leaves, are those of transformers' own dynamic cache."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from offload_core.serve.cache import with_room
from offload_core.serve.engine import Engine, Request
from offload_core.serve.sampling import Params

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40, 41]]


def passes(model, room: bool) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every pass's logits and each request's tokens: two requests, a third joining at step 2, a fourth at step 5
    (when one has left), lengths differing so that rows leave at different steps."""
    engine = Engine(model, None, torch.device("cpu"), slots=3, context=64)
    if not room:
        engine.new_cache = lambda: DynamicCache(config=model.config)
    seen: list[torch.Tensor] = []
    forward = engine._forward
    engine._forward = lambda *args, **kwargs: seen.append(forward(*args, **kwargs)) or seen[-1]
    requests = [Request(p, Params(max_tokens=4 + 3 * i, temperature=0)) for i, p in enumerate(PROMPTS)]
    joins = {0: [0, 1], 2: [2], 5: [3]}
    with torch.inference_mode():
        for step in range(100):
            for i in joins.get(step, []):
                engine.submit(requests[i])
            if not engine.step() and step > 5:
                break
    return seen, [r.tokens for r in requests]


def test_logits_through_joins_and_leaves_are_those_of_the_dynamic_cache(model):
    with_it, tokens = passes(model, room=True)
    without, plain_tokens = passes(model, room=False)
    assert tokens == plain_tokens and all(len(t) == 4 + 3 * i for i, t in enumerate(tokens))
    assert len(with_it) == len(without)
    assert all(torch.equal(a, b) for a, b in zip(with_it, without))


def test_a_decoding_step_writes_into_the_room_without_copying(model):
    cache = with_room(DynamicCache(config=model.config), limit=64)
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    layer = cache.layers[0]
    keys, values = torch.randn(2, heads, 5, dim), torch.randn(2, heads, 5, dim)
    layer.update(keys, values)
    buffer = layer.keys.data_ptr()
    for step in range(5):  # room for twice the prompt: the next five columns go in place
        new = torch.randn(2, heads, 1, dim)
        got, _ = layer.update(new, new)
        assert got.data_ptr() == buffer and got.shape[-2] == 6 + step
        assert torch.equal(got[:, :, -1:], new) and torch.equal(got[:, :, :5], keys)
    layer.update(new, new)  # full: a new buffer, the columns kept
    assert layer.keys.shape[-2] == 11 and torch.equal(layer.keys[:, :, :5], keys)
    layer.keys = layer.keys[[1]]  # rows left (as the batch cache drops them): the next step adopts the new tensor
    got, _ = layer.update(new[:1], new[:1])
    assert got.shape == (1, heads, 12, dim) and torch.equal(got[:, :, :5], keys[[1]])
