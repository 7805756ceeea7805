"""graphs=true on the fake accelerator: a prefetch-offloaded Llama from pinned memory, its decoding steps captured and
replayed, generates the tokens and logits of the in-memory model with the same static cache; the captured schedule
has no host synchronization and no hazard, and a schedule that reuses a slot too early fails."""

from __future__ import annotations

import pytest
import torch

import offload_core
from offload_core.devices.fake.graph import CaptureError
from offload_core.devices.fake.timeline import HazardError
from offload_core.errors import GraphsError
from offload_core.module_hooks.graphs import DecodeGraphs, StaticRing, apply_graphs, graph_pool_bytes


def _generate(model, ids, tokens=5):
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=tokens,
            do_sample=False,
            cache_implementation="static",
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences.cpu(), [s.cpu() for s in out.logits]


def _graphs_hook(model) -> DecodeGraphs:
    return next(h for h in model.__dict__["_offload_module_hooks"] if isinstance(h, DecodeGraphs))


@pytest.fixture
def llama_run(saved, fake_gpu):
    fake = fake_gpu(count=1, memory="256MiB")
    llama = saved("llama")
    ids = llama.inputs["input_ids"][:1].to(fake.device(0))
    reference = llama.auto.from_pretrained(llama.path).eval().to(fake.device(0))
    return fake, llama, ids, reference


def test_offloaded_graphs_generate_what_the_in_memory_model_does(llama_run):
    fake, llama, ids, reference = llama_run
    want_ids, want_logits = _generate(reference, ids)
    apply_graphs(reference)  # in memory, with graphs: the same again
    got_ids, got_logits = _generate(reference, ids)
    assert torch.equal(got_ids, want_ids) and all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    assert _graphs_hook(reference).replays == 3
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    del reference
    model = offload_core.from_pretrained(
        llama.path,
        max_memory={0: total // 3 + graph_pool_bytes(llama.config, dtype=torch.float32)},
        storage="pinned_cpu",
        graphs=True,
        execution_device=fake.device(0),
    )
    try:
        ring = model.offload_state.handle.prefetcher
        assert isinstance(ring, StaticRing) and len(ring.units) >= 2
        hook = _graphs_hook(model)
        for _ in range(2):  # a second call captures again (a new cache) and still matches
            got_ids, got_logits = _generate(model, ids)
            assert torch.equal(got_ids, want_ids)
            assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
        # prompt, one eager decoding step (the warm-up), then 3 replays of the captured step, per call
        assert (hook.captures, hook.replays, hook.eager_steps) == (2, 6, 2)
        assert not fake.hazards
    finally:
        model.offload_state.remove()


def test_a_ring_that_reuses_a_slot_before_its_reader_finished_is_a_hazard(llama_run, monkeypatch):
    fake, llama, ids, reference = llama_run
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    del reference
    model = offload_core.from_pretrained(
        llama.path,
        max_memory={0: total // 3 + graph_pool_bytes(llama.config, dtype=torch.float32)},
        storage="pinned_cpu",
        graphs=True,
        execution_device=fake.device(0),
    )
    # the copy into a slot no longer waits for the compute that last read it
    monkeypatch.setattr(StaticRing, "slot_of", lambda self, index: index % self.slots_count)
    original = StaticRing._copy

    def careless(self, q):
        self._freed = [None] * self.slots_count
        original(self, q)

    monkeypatch.setattr(StaticRing, "_copy", careless)
    try:
        with pytest.raises(HazardError):
            _generate(model, ids)
    finally:
        fake.timeline.hazards.clear()
        model.offload_state.remove()


def test_a_host_synchronization_inside_the_captured_step_raises(fake_gpu):
    fake = fake_gpu(count=1, memory="16MiB")
    device = fake.device(0)
    x = torch.ones(4, device=device)
    graph = fake.new_graph()
    with pytest.raises(CaptureError, match="host"):
        with fake.graph_capture(graph, device):
            (x * 2).sum().item()
    side = fake.new_stream(device)
    with pytest.raises(CaptureError, match="never waited"):
        with fake.graph_capture(graph, device):
            with fake.on_stream(side):
                x.add_(1)
    fake.synchronize()
    fake.timeline.hazards.clear()


def test_replay_recomputes_from_the_inputs_and_the_capture_runs_nothing(fake_gpu):
    fake = fake_gpu(count=1, memory="16MiB")
    device = fake.device(0)
    x, w = torch.ones(4, device=device), torch.full((4,), 2.0, device=device)
    count = torch.zeros(1, device=device)
    graph = fake.new_graph()
    with fake.graph_capture(graph, device):
        y = x * w + 1
        count.add_(1)
    assert count.cpu().item() == 0  # a capture runs nothing
    x.copy_(torch.arange(4.0).to(device))
    fake.replay(graph)
    assert torch.equal(y.cpu(), torch.tensor([1.0, 3.0, 5.0, 7.0])) and count.cpu().item() == 1
    fake.synchronize()  # the graph's pool is let go at the end


def test_graphs_are_refused_where_they_cannot_apply(saved, tmp_path):
    llama = saved("llama")
    with pytest.raises(GraphsError, match="CUDA GPU; this run computes on cpu"):
        offload_core.from_pretrained(llama.path, graphs=True)
