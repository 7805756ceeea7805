"""The serving engine without HTTP: continuous batching gives the tokens transformers gives (alone with
serve.exact=true; for the same batch composition otherwise, offloaded or in memory), requests join and leave between
steps, a cancelled one frees its slot, a full queue refuses, a failing request fails alone."""

from __future__ import annotations

import pytest
import torch

from offload_core.jobs.batch import left_padded
from offload_core.serve.engine import Engine, QueueFull, Request
from offload_core.serve.sampling import Detokenizer, Params

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40, 41]]
NEW = 10


def greedy(tokens: int = NEW) -> Params:
    return Params(max_tokens=tokens, temperature=0)


def run_schedule(engine: Engine, joins: dict[int, list[int]], tokens: int = NEW) -> list[list[int]]:
    """Submit ``PROMPTS[i]`` for each i in ``joins[step]`` before that step, step until idle; each request's tokens."""
    requests = [Request(p, greedy(tokens)) for p in PROMPTS]
    with torch.inference_mode():
        for step in range(200):
            for i in joins.get(step, []):
                engine.submit(requests[i])
            if not engine.step() and step > max(joins):
                break
    assert engine.idle()
    return [r.tokens for r in requests]


def alone(model, prompt: list[int], tokens: int = NEW) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_exact_gives_each_request_its_tokens_alone(model):
    engine = Engine(model, None, torch.device("cpu"), slots=3, context=64, exact=True)
    got = run_schedule(engine, {0: [0, 1], 3: [2], 4: [3]})
    assert got == [alone(model, p) for p in PROMPTS]


def test_requests_starting_together_get_transformers_batch_tokens(model):
    engine = Engine(model, None, torch.device("cpu"), slots=3, context=64)
    got = run_schedule(engine, {0: [0, 1, 2]})
    ids, mask = left_padded(PROMPTS[:3], 0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert got[:3] == out[:, ids.shape[1] :].tolist()


@pytest.mark.parametrize(
    "storage, policy",
    [("memmap", "align_per_call"), ("safetensors", "prefetch"), ("pinned_cpu", "chained")]
    + [("memmap", policy) for policy in ("functional_call", "experts")],
)
def test_offloaded_model_gives_the_in_memory_tokens_for_the_same_batch_composition(
    model, folder, tmp_path, storage, policy
):
    import offload_core

    offloaded = offload_core.from_pretrained(
        folder,
        offload={
            "storage": storage,
            "policy": policy,
            "headroom": 0,
            "offload_folder": tmp_path / "off",
            "over_budget": "warn",  # pinned_cpu holds the disk tier in memory, over the 1 KiB
        },
        max_memory={"cpu": 1024},
    )
    assert offloaded.offload_state.offloaded_bytes() > 0
    joins = {0: [0, 1], 2: [2], 5: [3]}  # requests join mid-flight; the slots (3) make the fourth wait for one
    on_disk = run_schedule(Engine(offloaded, None, torch.device("cpu"), slots=3, context=64), joins)
    in_memory = run_schedule(Engine(model, None, torch.device("cpu"), slots=3, context=64), joins)
    assert on_disk == in_memory
    assert all(len(t) == NEW for t in on_disk)


def test_one_forward_makes_a_token_for_every_request(model):
    engine = Engine(model, None, torch.device("cpu"), slots=4, context=64)
    run_schedule(engine, {0: [0, 1, 2, 3]})
    # one prefill of all four, then NEW - 1 steps each making four tokens
    assert engine.metrics.passes_count == NEW
    assert engine.metrics.generated_count == 4 * NEW


def test_a_cancelled_request_frees_its_slot_and_cache_rows(model):
    engine = Engine(model, None, torch.device("cpu"), slots=2, context=64)
    first, second, third = (Request(p, greedy(30)) for p in PROMPTS[:3])
    with torch.inference_mode():
        for request in (first, second, third):
            engine.submit(request)
        engine.step()
        engine.step()
        assert engine.active == 2 and len(engine.waiting) == 1
        engine.cancel(first)
        engine.step()  # drops it, then the third is prefilled into its slot
        assert engine.active == 2 and not engine.waiting
        assert engine.groups[0].cache.rows == 2 and engine.groups[0].rows == [second, third]
        steps = len(first.tokens)
        for _ in range(100):
            if not engine.step():
                break
    assert len(first.tokens) == steps < 30
    assert len(second.tokens) == len(third.tokens) == 30


def test_a_full_queue_refuses(model):
    engine = Engine(model, None, torch.device("cpu"), slots=1, context=64, max_queue=1)
    engine.submit(Request(PROMPTS[0], greedy()))
    engine.submit(Request(PROMPTS[1], greedy()))
    with pytest.raises(QueueFull):
        engine.submit(Request(PROMPTS[2], greedy()))


def test_a_failing_request_fails_alone(model):
    engine = Engine(model, None, torch.device("cpu"), slots=2, context=64)
    events: list = []
    bad = Request(PROMPTS[0], greedy(), emit=events.append)
    good = Request(PROMPTS[1], greedy())
    engine.submit(bad)
    engine.submit(good)

    def broken(logits):
        raise ValueError("this request's sampling broke")

    bad.picker.pick = broken
    with torch.inference_mode():
        for _ in range(50):
            if not engine.step():
                break
    assert bad.finish_reason == "error" and "sampling broke" in events[-1].error
    assert good.tokens == alone(model, PROMPTS[1])


def test_seeded_sampling_repeats_and_the_seed_matters(model):
    def sample(seed: int) -> list[int]:
        engine = Engine(model, None, torch.device("cpu"), slots=1, context=64)
        request = Request(PROMPTS[0], Params(max_tokens=12, temperature=1.5, top_p=0.95, seed=seed))
        engine.submit(request)
        with torch.inference_mode():
            while engine.step():
                pass
        return request.tokens

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_stop_strings_end_the_text_and_are_not_sent():
    class Letters:  # a tokenizer whose token i is the letter chr(i)
        def decode(self, tokens, skip_special_tokens=True):
            return "".join(chr(t) for t in tokens)

    text = Detokenizer(Letters(), ("END",))
    pieces = [text.feed(ord(c)) for c in "abcEN"]
    assert "".join(pieces) == "abc"  # "EN" held back: it may start the stop string
    assert text.feed(ord("D")) == "" and text.stopped and text.text == "abc"


def test_a_fault_outside_a_forward_fails_those_generating_and_the_engine_goes_on(model):
    import threading

    engine = Engine(model, None, torch.device("cpu"), slots=2, context=64)
    real, faults = engine._decode, []

    def faulty(group):
        if not faults:
            faults.append(group)
            raise RuntimeError("a fault between forwards")
        real(group)

    engine._decode = faulty
    ended = {name: threading.Event() for name in ("first", "second")}
    events: dict[str, list] = {name: [] for name in ended}

    def emit_to(name):
        def emit(event):
            events[name].append(event)
            if event.done:
                ended[name].set()

        return emit

    engine.start()
    try:
        engine.submit(Request(PROMPTS[0], greedy(), emit=emit_to("first")))
        assert ended["first"].wait(timeout=60)
        engine.submit(Request(PROMPTS[1], greedy(), emit=emit_to("second")))
        assert ended["second"].wait(timeout=60)
    finally:
        engine.stop()
    assert "a fault between forwards" in events["first"][-1].error
    assert events["second"][-1].finish_reason in ("length", "stop") and not events["second"][-1].error


def test_logprobs_are_the_models_own_for_each_token_with_the_likeliest_alternatives(model):
    engine = Engine(model, None, torch.device("cpu"), slots=2, context=64, exact=True)
    events = []
    request = Request(PROMPTS[0], Params(max_tokens=4, temperature=0.7, seed=3, logprobs=3), emit=events.append)
    engine.submit(request)
    with torch.inference_mode():
        while engine.step():
            pass
    ids = torch.tensor([PROMPTS[0] + request.tokens])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(PROMPTS[0]) - 1 : -1].float()
    expected = torch.log_softmax(logits, dim=-1)
    got = [item for event in events for item in event.logprobs]
    assert [item.text for item in got] == [str(t) for t in request.tokens]  # no tokenizer: ids as text
    for row, (item, token) in enumerate(zip(got, request.tokens)):
        # the distribution before temperature, as OpenAI's clients read it, whatever was sampled
        assert item.logprob == pytest.approx(float(expected[row, token]), abs=1e-4)
        assert [int(t) for t, _ in item.top] == expected[row].topk(3).indices.tolist()
        assert [lp for _, lp in item.top] == pytest.approx(expected[row].topk(3).values.tolist(), abs=1e-4)
    silent = []
    engine.submit(Request(PROMPTS[1], greedy(3), emit=silent.append))
    with torch.inference_mode():
        while engine.step():
            pass
    assert silent and not any(event.logprobs for event in silent)


def test_requests_sent_together_are_prefilled_in_one_forward(model):
    import threading
    import time

    engine = Engine(model, None, torch.device("cpu"), slots=3, context=64)
    engine.gather_quiet_s, engine.gather_s = 2.0, 10.0  # the machine may be slow: a quiet period far above it
    requests = [Request(p, greedy(2)) for p in PROMPTS[:3]]
    engine.submit(requests[0])
    late = threading.Thread(target=lambda: [time.sleep(0.05) or engine.submit(r) for r in requests[1:]])
    began = time.perf_counter()
    late.start()
    engine.gather()  # returns once the three fill the slots, not after a quiet period
    late.join()
    assert time.perf_counter() - began < 2.0 and len(engine.waiting) == 3
    with torch.inference_mode():
        engine.step()
    assert engine.active == 3 and engine.metrics.passes_count == 1
    lone = Engine(model, None, torch.device("cpu"), slots=3, context=64)
    lone.gather_quiet_s, lone.gather_s = 0.2, 10.0
    lone.submit(Request(PROMPTS[0], greedy(2)))
    began = time.perf_counter()
    lone.gather()  # nothing more comes: it waits one quiet period
    assert 0.2 <= time.perf_counter() - began < 5.0
