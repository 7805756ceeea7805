"""Prompt-lookup speculation inside the serving engine: every request drafts from its own text, one forward checks
all drafts, and each request gets the tokens it gets without speculation (greedy, and seeded sampling) in fewer
forwards on a repetitive text; ``mode=serve speculative=prompt_lookup`` starts and answers as a process."""

from __future__ import annotations

import pytest
import torch
import transformers

from offload_core.serve.cache import BatchCache
from offload_core.serve.engine import Engine, Request
from offload_core.serve.sampling import Params
from offload_core.speculative import read_speculative

from tests import preloaded

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40, 41], list(range(30, 45)) * 3]
NEW = 30
LOOKUP = read_speculative("prompt_lookup")


def run_schedule(engine: Engine, joins: dict[int, list[int]], params: Params) -> list[list[int]]:
    """Submit ``PROMPTS[i]`` for each i in ``joins[step]`` before that step, step until idle; each request's tokens."""
    requests = {i: Request(PROMPTS[i], params) for step in joins.values() for i in step}
    with torch.inference_mode():
        for step in range(500):
            for i in joins.get(step, []):
                engine.submit(requests[i])
            if not engine.step() and step > max(joins):
                break
    assert engine.idle()
    return [requests[i].tokens for i in sorted(requests)]


def engine(model, speculative=None, context: int = 128, **kwargs) -> Engine:
    return Engine(model, None, torch.device("cpu"), context=context, speculative=speculative, **kwargs)


JOINS = {0: [0, 1], 2: [2], 3: [4], 6: [3]}  # joining mid-flight; three slots make the last wait for one


@pytest.mark.parametrize("exact", [False, True])
def test_greedy_requests_get_their_tokens_without_speculation(model, exact):
    plain = engine(model, slots=3, exact=exact)
    speculating = engine(model, LOOKUP, slots=3, exact=exact)
    greedy = Params(max_tokens=NEW, temperature=0)
    expected = run_schedule(plain, JOINS, greedy)
    assert run_schedule(speculating, JOINS, greedy) == expected
    assert all(len(tokens) == NEW for tokens in expected)
    metrics = speculating.metrics
    assert 0 < metrics.accepted_count <= metrics.drafted_count
    assert metrics.passes_count < plain.metrics.passes_count
    assert metrics.generated_count == plain.metrics.generated_count == NEW * len(PROMPTS)


def test_exact_speculation_gives_each_request_its_tokens_alone(model):
    got = run_schedule(engine(model, LOOKUP, slots=3, exact=True), JOINS, Params(max_tokens=NEW, temperature=0))
    for prompt, tokens in zip(PROMPTS, got):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        assert tokens == out[0, len(prompt) :].tolist()


def test_seeded_sampling_picks_the_same_tokens_with_speculation(model):
    # the tiny model's logits lie close together: a low temperature samples near the tokens the drafts copy
    sampled = Params(max_tokens=NEW, temperature=0.05, seed=7)
    joins = {0: [0, 1, 4]}
    plain = run_schedule(engine(model, slots=3), joins, sampled)
    assert plain != run_schedule(engine(model, slots=3), joins, Params(max_tokens=NEW, temperature=0))
    speculating = engine(model, LOOKUP, slots=3)
    assert run_schedule(speculating, joins, sampled) == plain
    assert 0 < speculating.metrics.accepted_count < speculating.metrics.drafted_count


def test_a_repetitive_prompt_takes_fewer_forwards(model):
    def forwards(speculative) -> tuple[list[int], int]:
        served = engine(model, speculative, slots=1)
        tokens = run_schedule(served, {0: [4]}, Params(max_tokens=40, temperature=0))
        return tokens, served.metrics.passes_count

    (plain, without), (spec, with_lookup) = forwards(None), forwards(LOOKUP)
    assert spec == plain and without == 40
    assert with_lookup <= without // 2


def test_drafts_stop_at_max_tokens_and_the_context(model):
    context, greedy = len(PROMPTS[4]) + 12, Params(max_tokens=12, temperature=0)
    served = engine(model, LOOKUP, context, slots=2)
    widths = []
    forward = served._forward
    served._forward = lambda ids, mask, *args, **kwargs: (
        widths.append(mask.shape[1]) or forward(ids, mask, *args, **kwargs)
    )
    tokens = run_schedule(served, {0: [0, 4]}, greedy)
    assert tokens == run_schedule(engine(model, None, context, slots=2), {0: [0, 4]}, greedy)
    assert served.metrics.drafted_count > 0 and [len(t) for t in tokens] == [12, 12]
    assert max(widths) <= context  # no row ever held more than the context the plan holds KV cache for


def test_settle_drops_each_rows_rejected_columns():
    from transformers import DynamicCache

    cache = DynamicCache()
    keys = torch.arange(2 * 6, dtype=torch.float32).reshape(2, 1, 6, 1) + 1
    cache.update(keys, keys.clone(), 0)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    batch = BatchCache(cache, mask)
    batch.settle([1, 3], added=3)  # row 0 keeps 1 of its last 3 columns, row 1 keeps all 3
    assert batch.mask.tolist() == [[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert cache.layers[0].keys[:, 0, :, 0].tolist() == [[0, 0, 1, 2, 3, 4], [7, 8, 9, 10, 11, 12]]
    batch.settle([1, 2], added=3)  # then the first column holds no row's token: it is cut
    assert batch.mask.tolist() == [[0, 0, 0, 0, 1], [1, 1, 1, 1, 1]]
    assert cache.layers[0].keys[:, 0, :, 0].tolist() == [[0, 0, 0, 1, 2], [7, 8, 9, 10, 11]]
    assert cache.layers[0].values.shape == cache.layers[0].keys.shape == (2, 1, 5, 1)


@pytest.mark.slow
def test_the_server_speculates_per_request_and_says_so_in_its_metrics(folder, model, tmp_path):
    from tests.serve.server import call, metric, start_server, stop_server

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    expected = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    proc, url = start_server(
        folder, tmp_path, "speculative=prompt_lookup", "serve.max_batch=2", "serve.context=128", "serve.model_name=tiny"
    )
    try:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0}
        status, answer = call(url, "POST", "/v1/completions", body)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == expected
        accepted = metric(url, "offload_core_serve_accepted_tokens_total")
        assert 0 < accepted <= metric(url, "offload_core_serve_drafted_tokens_total")
        passes = metric(url, "offload_core_serve_forward_passes_total")
        assert passes < metric(url, "offload_core_serve_generated_tokens_total")
    finally:
        code, printed, err = stop_server(proc)
    assert code == 0, err[-2000:]
    assert "served 1 requests" in printed and f"{int(accepted)} of " in printed


@pytest.mark.slow
def test_bench_serve_speculation_writes_its_report(folder, tmp_path):
    import json
    import sys

    from tests import ROOT
    from tests.end_to_end.helpers import child_env
    from tests.serve.server import OFFLOADED

    done = preloaded.run(
        [sys.executable, "bench/serve_speculation.py", "--clients", "1,2", "--tokens", "8", "--tag", "tiny"]
        + ["--out", str(tmp_path), "model=local", f"model.path={folder}", "serve.context=128", *OFFLOADED],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=280,
        nested=True,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "serve-speculation-tiny.json").read_text())
    assert set(result["runs"]) == {"none", "prompt_lookup"} and result["same_text"] is True
    plain, speculating = result["runs"]["none"]["loads"], result["runs"]["prompt_lookup"]["loads"]
    assert [row["clients"] for row in speculating] == [1, 2]
    assert [row["generated_tokens"] for row in speculating] == [row["generated_tokens"] for row in plain]
    assert all(row["drafted_tokens"] == 0 for row in plain)
    assert "| prompt_lookup | 2 |" in (tmp_path / "serve-speculation-tiny.md").read_text()
