"""On a GPU the prefetch hooks never make the host wait: a steady decoding step from a pinned store issues each unit's
next copies before the unit's kernels, on the compute thread (no hand-off to wait for), and adds no host
synchronization to what the in-memory model's step does (the fake accelerator counts every one)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from offload_core import dispatch_model
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
from tests.module_hooks.prefetch_model import tiny_llama

#: layers 0, 1 and 3 in pinned host memory, streamed through the pool; the rest on GPU 0
MAP = {
    "model.embed_tokens": 0,
    "model.layers.0": "cpu",
    "model.layers.1": "cpu",
    "model.layers.2": 0,
    "model.layers.3": "cpu",
    "model.norm": 0,
    "model.rotary_emb": 0,
    "lm_head": 0,
}
IDS = torch.tensor([[5, 6, 7, 8, 9]])


def _decoder(model, device):
    """Steps of greedy decoding by forward calls, the next token kept on the device (no read back)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        token = model(IDS.to(device), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

    def step():
        nonlocal token
        with torch.no_grad():
            logits = model(token, past_key_values=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        return logits

    return step


def _main_thread_waits(fake, step) -> tuple[int, torch.Tensor]:
    fake.timeline.host_waits.clear()
    logits = step()
    waits = sum(n for (thread, _), n in fake.timeline.host_waits.items() if thread == "MainThread")
    return waits, logits


def test_a_steady_decoding_step_adds_no_host_wait_and_issues_copies_ahead(fake_gpu):
    fake = fake_gpu(count=1, memory="64MiB")
    device = fake.device(0)
    reference = tiny_llama().to(device)
    model = tiny_llama()
    dispatch_model(model, MAP, storage="pinned_cpu", policy=Prefetch(PrefetchConfig(depth=2)))
    prefetcher = model.offload_state.handle.prefetcher
    assert prefetcher.inline and prefetcher.staging is None  # copies from pinned memory: issued where they are needed
    ours, theirs = _decoder(model, device), _decoder(reference, device)
    for _ in range(2):  # the execution order is recorded; every unit is read ahead from now on
        ours(), theirs()
    issued = []
    load = prefetcher.load

    def watched(index):
        load(index)  # returns just before the unit's kernels are launched
        issued.append((index, sorted(prefetcher.pending), all(f.done() for f, _, _ in prefetcher.pending.values())))

    prefetcher.load = watched
    late, misses, waits = prefetcher.late, prefetcher.misses, prefetcher.block_pool.waits
    base, expected = _main_thread_waits(fake, theirs)
    added, logits = _main_thread_waits(fake, ours)
    assert added == base  # not one host wait of ours on the compute thread
    assert torch.equal(logits.cpu(), expected.cpu())
    assert (prefetcher.late, prefetcher.misses, prefetcher.block_pool.waits) == (late, misses, waits)
    # each unit's next two along the recorded order are in flight, their copies queued, before its own kernels
    assert issued == [(0, [1, 2], True), (1, [0, 2], True), (2, [0, 1], True)]

    # the check has teeth: a compute stream that has the host wait for each unit's copies shows as three waits a step
    compute_waits = prefetcher.accel.compute_waits
    prefetcher.accel.compute_waits = lambda event: (prefetcher.accel.host_waits(event), compute_waits(event))
    base, _ = _main_thread_waits(fake, theirs)
    added, _ = _main_thread_waits(fake, ours)
    assert added == base + 3
    prefetcher.accel.compute_waits = compute_waits
    model.offload_state.remove()
