"""Readers never wait for what only a waiting read could give back, and no thread of ours outlives a run.

Every policy x store on a transformers-saved tiny Mixtral (tied and untied head), a quarter of it in the cpu budget,
prefetch also at its smallest pool (depth 1, copying into the pool), with and without a kept page-cache set:
generation ends (within a bound, on a watchdog) with the in-memory model's tokens; once the run releases the model
(``offload_state.release()``, as ``run.py`` does) no ``offload-`` thread is alive, nor after ``remove()``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig

import offload_core
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
from offload_core.module_hooks.reader import THREAD_PREFIX, Reader
from offload_core.planning import compute_module_sizes

POLICIES = {
    "align_per_call": lambda: "align_per_call",
    "chained": lambda: "chained",
    "functional_call": lambda: "functional_call",
    "prefetch": lambda: "prefetch",
    "prefetch-smallest-pool": lambda: Prefetch(PrefetchConfig(depth=1, pool=True)),
    "experts": lambda: "experts",
}
#: a generate that has not ended by then is a deadlock (the tiny model generates in well under a second)
WATCHDOG_S = 60


def ours() -> set[threading.Thread]:
    """Our threads alive now (compared by identity: one an earlier test left, such as a folder's sealer, may end
    while this test runs)."""
    return {t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)}


def names(threads: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threads)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def mixtral(request, tmp_path_factory):
    config = MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        tie_word_embeddings=request.param,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    path = tmp_path_factory.mktemp("mixtral") / "ckpt"
    model.save_pretrained(path, max_shard_size="40KB")
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0
        )
    return path, ids, tokens, compute_module_sizes(reference)[""]


STORES = ["memmap", "safetensors", "pinned_cpu"]
#: every policy x store x page cache (a kept set is for the stores that read files: pinned_cpu's error is tested in
#: test_keep) on the tied and the untied head; the quick subset takes one head of each, turning
CASES = [
    pytest.param(
        tied,
        policy,
        store,
        kept,
        id=f"{'tied' if tied else 'untied'}-{policy}-{store}-{'kept-set' if kept else 'lru'}",
        marks=() if (i + j + k + tied) % 2 == 0 else pytest.mark.slow,
    )
    for tied in (True, False)
    for i, policy in enumerate(POLICIES)
    for j, store in enumerate(STORES)
    for k, kept in enumerate([None, "auto"])
    if not (kept and store == "pinned_cpu")
]


@pytest.mark.parametrize("mixtral, policy, store, kept", CASES, indirect=["mixtral"])
def test_generation_ends_and_no_reader_outlives_the_run(mixtral, policy, store, kept, tmp_path):
    path, ids, want_tokens, total = mixtral
    before = ours()
    model = offload_core.from_pretrained(
        path,
        offload={
            "storage": store,
            "policy": POLICIES[policy](),
            "offload_folder": tmp_path / "off",
            "page_cache": kept,
            "headroom": 0,
            "over_budget": "warn",  # the tiny blocks are larger than a quarter of the model
        },
        max_memory={"cpu": total // 4},
    )
    assert "disk" in set(model.hf_device_map.values())
    got: list = []

    def run() -> None:
        with torch.no_grad():
            for _ in range(
                2
            ):  # a second generate starts along the recorded order, with read-aheads left from the first
                got.append(
                    model.generate(
                        ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0
                    )
                )

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(WATCHDOG_S)
    assert not worker.is_alive(), f"generation did not end within {WATCHDOG_S} s (threads: {names(ours())})"
    assert len(got) == 2 and all(torch.equal(t, want_tokens) for t in got)
    model.offload_state.release()
    assert not ours() - before, f"a reader thread outlived offload_state.release(): {names(ours() - before)}"


@pytest.mark.parametrize("policy", ["prefetch", "experts"])
def test_no_reader_outlives_remove(mixtral, policy, tmp_path):
    path, ids, want_tokens, total = mixtral
    before = ours()
    model = offload_core.from_pretrained(
        path,
        offload={"storage": "safetensors", "policy": policy, "headroom": 0, "over_budget": "warn"},
        max_memory={"cpu": total // 4},
    )
    with torch.no_grad():
        assert torch.equal(
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0),
            want_tokens,
        )
    assert ours() - before  # the reader ran
    model.offload_state.remove()
    assert not ours() - before, f"a reader thread outlived offload_state.remove(): {names(ours() - before)}"


def test_reader_stops_cancels_what_has_not_started_and_starts_again():
    reader = Reader("test")
    gate = threading.Event()
    started = threading.Event()

    def block() -> str:
        started.set()
        gate.wait(WATCHDOG_S)
        return "ran"

    first = reader.submit(block)
    queued = reader.submit(lambda: "never")
    assert started.wait(WATCHDOG_S) and reader.running
    threading.Timer(0.05, gate.set).start()  # stop() must wait for the running read, then cancel the queued one
    reader.stop()
    assert first.result() == "ran" and queued.cancelled()
    assert not reader.running and not [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX + "test")]
    assert reader.submit(lambda: 7).result(WATCHDOG_S) == 7  # started again
    reader.stop()
