"""graphs=true on the fake accelerator: a prefetch-offloaded Llama from pinned memory, its decoding steps captured and
replayed, generates the tokens and logits of the in-memory model with the same static cache; the captured schedule
has no host synchronization and no hazard, and a schedule that reuses a slot too early fails."""

from __future__ import annotations

import logging

import pytest
import torch

import offload_core
from offload_core.module_hooks.graphs import decode as decode_module
from offload_core.devices.fake.graph import CaptureError
from offload_core.devices.fake.timeline import HazardError
from offload_core.errors import GraphsError
from offload_core.module_hooks.graphs import DecodeGraphs, StaticRing, apply_graphs, graph_pool_bytes
from tests.logs import records_of

from tests import preloaded


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
    assert reference.generation_config.disable_compile  # transformers' compile of a static cache would trace the hook
    got_ids, got_logits = _generate(reference, ids)
    assert torch.equal(got_ids, want_ids) and all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    assert _graphs_hook(reference).replays == 3
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    del reference
    model = offload_core.from_pretrained(
        llama.path,
        offload={"storage": "pinned_cpu", "graphs": True, "execution_device": fake.device(0), "over_budget": "warn"},
        max_memory={0: total // 2 + graph_pool_bytes(llama.config, dtype=torch.float32)},
        generation={"max_new_tokens": 5, "prompt_tokens": ids.shape[1]},
    )
    try:
        ring = model.offload_state.handle.prefetcher
        assert isinstance(ring, StaticRing) and len(ring.units) >= 2
        assert model.generation_config.disable_compile
        hook = _graphs_hook(model)
        for _ in range(2):  # a second call captures again (a new cache) and still matches
            got_ids, got_logits = _generate(model, ids)
            assert torch.equal(got_ids, want_ids)
            assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
        # prompt, one eager decoding step (the warm-up, once), then replays of the step captured in each call
        assert (hook.captures, hook.replays, hook.eager_steps) == (2, 7, 1)
        assert not fake.hazards
    finally:
        model.offload_state.remove()


@pytest.mark.parametrize("mistake", ["slot reused before its reader finished", "compute before its copy"])
def test_a_wrong_ring_schedule_is_a_hazard(llama_run, mistake):
    fake, llama, ids, reference = llama_run
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    del reference
    model = offload_core.from_pretrained(
        llama.path,
        offload={"storage": "pinned_cpu", "graphs": True, "execution_device": fake.device(0), "over_budget": "warn"},
        max_memory={0: total // 2 + graph_pool_bytes(llama.config, dtype=torch.float32)},
        generation={"max_new_tokens": 5, "prompt_tokens": ids.shape[1]},
    )
    ring = model.offload_state.handle.prefetcher
    if mistake == "compute before its copy":
        ring.accel.compute_waits = lambda event: None
    else:
        copy = ring._copy

        def careless(q):  # the copy into a slot no longer waits for the compute that last read it
            ring._freed = [None] * ring.slots_count
            copy(q)

        ring._copy = careless
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
    count, position = torch.zeros(1, device=device), torch.tensor([3]).to(device)
    graph = fake.new_graph()
    with fake.graph_capture(graph, device), torch.inference_mode():
        y = x * w + 1
        count.add_(1)
        z = position[..., None].float() * w  # under inference mode ``to`` dispatches as a view, yet converts
    assert count.cpu().item() == 0  # a capture runs nothing
    x.copy_(torch.arange(4.0).to(device))
    position.fill_(5)
    fake.replay(graph)
    assert torch.equal(y.cpu(), torch.tensor([1.0, 3.0, 5.0, 7.0])) and count.cpu().item() == 1
    assert torch.equal(z.cpu(), torch.full((1, 4), 10.0))
    fake.synchronize()  # the graph's pool is let go at the end


def test_graphs_are_refused_where_they_cannot_apply(saved, tmp_path):
    llama = saved("llama")
    with pytest.raises(GraphsError, match="CUDA GPU; this run computes on cpu"):
        offload_core.from_pretrained(llama.path, offload={"graphs": True})


@pytest.mark.slow  # a whole run on the fake GPU (the quick subset stays under a minute)
def test_a_run_with_graphs_matches_the_in_memory_model_and_stays_in_its_budget(tmp_path, fake_gpu, compose_run):
    from offload_core.runner.job import run

    budget = 2 * 2**20
    fake_gpu(count=1, memory=4 * budget)
    cfg = compose_run(
        [
            "model=synthetic",
            "hook=prefetch",
            "storage=pinned_cpu",
            "graphs=true",
            "max_new_tokens=5",
            "progress=false",
            "compare_in_memory=true",
            f"+max_memory.0={budget}",
            "max_memory.cpu=200MiB",
        ]
    )
    result = run(cfg, output_dir=tmp_path)
    assert result.matches_in_memory is True, (result.token_ids, result.figures["in_memory_tokens"])
    assert 0 in set(result.device_map.values()) and set(result.device_map.values()) - {0}
    assert result.figures["peak_gpu_bytes"]["0"] <= budget


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["hook=align_per_call", "storage=pinned_cpu"], "use hook=prefetch"),
        (["hook=prefetch", "storage=safetensors"], "use storage=pinned_cpu"),
        (["hook=prefetch", "storage=pinned_cpu", "speculative=prompt_lookup"], "speculative decoding"),
    ],
)
def test_a_run_refuses_graphs_it_cannot_capture(overrides, says, fake_gpu, compose_run, tmp_path):
    from offload_core.runner.job import run

    fake_gpu(count=1, memory="64MiB")
    cfg = compose_run(["model=synthetic", "graphs=true", "progress=false", *overrides])
    with pytest.raises(GraphsError, match=says):
        run(cfg, output_dir=tmp_path)


@pytest.mark.slow  # run.py as a process
def test_the_cli_refuses_graphs_on_a_cpu_in_one_line(tmp_path):
    import sys

    from tests import ROOT

    done = preloaded.run(
        [sys.executable, str(ROOT / "run.py"), "model=synthetic", "graphs=true", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("offload_core: error:")]
    assert errors == ["offload_core: error: graphs=true captures decoding steps on a CUDA GPU; this run computes on "
                      "cpu: drop graphs"], done.stderr  # fmt: skip
    assert "Traceback" not in done.stderr


def test_a_step_that_cannot_be_captured_decodes_eagerly_and_says_so(llama_run):
    fake, llama, ids, reference = llama_run
    want_ids, want_logits = _generate(reference, ids)
    hook = apply_graphs(reference)
    norm = reference.model.norm
    forward = norm.forward

    def syncing(hidden):  # a host synchronization in the step: no graph can hold it
        float(hidden.sum())
        return forward(hidden)

    norm.forward = syncing
    with records_of(decode_module.__name__, logging.WARNING) as said:
        got_ids, got_logits = _generate(reference, ids)
    fake.timeline.hazards.clear()
    assert torch.equal(got_ids, want_ids) and all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    assert hook.failed and "host" in hook.failed and hook.replays == 0
    assert "test_graphs.py" in hook.failed and "in syncing" in hook.failed  # the line that asked for it
    assert any("decoding goes on without graphs" in line for line in said)
