"""A whole run on a fake GPU: the plan holds back the headroom and the policy's blocks in flight on the GPU, the
run stays inside the GPU budget, and compare_in_memory runs the reference where the run computes."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from offload_core.runner.job import run
from offload_core.runner.config import register_configs

from tests import ROOT

GPU_BUDGET = 2 * 2**20


@pytest.mark.parametrize(
    "hook,storage",
    [("prefetch", "pinned_cpu"), ("prefetch", "memmap"), ("align_per_call", "safetensors"), ("chained", "pinned_cpu")],
)
def test_a_run_on_a_gpu_stays_in_its_budget_and_compares_on_the_gpu(hook, storage, tmp_path, fake_gpu, monkeypatch):
    from offload_core.runner.modes import generate

    fake = fake_gpu(count=1, memory=4 * GPU_BUDGET)  # room for the reference model, which must fit whole
    references = []

    def reference_model(*args, **kwargs):  # the real one, watched: where did the reference compute?
        model = real(*args, **kwargs)
        references.append(next(model.parameters()).device)
        return model

    real = generate.reference_model
    monkeypatch.setattr(generate, "reference_model", reference_model)
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[
                "model=synthetic",
                f"hook={hook}",
                f"storage={storage}",
                "max_new_tokens=4",
                "progress=false",
                "compare_in_memory=true",
                f"+max_memory.0={GPU_BUDGET}",
                "max_memory.cpu=200MiB",
                "headroom=256KiB",
            ],
        )
    result = run(cfg, output_dir=tmp_path)
    assert result.matches_in_memory is True
    devices_used = set(result.device_map.values())
    assert 0 in devices_used and devices_used - {0}, result.device_map  # part on the GPU, part offloaded
    # the planned GPU bytes and the policy's reservation leave the headroom free, and with the activations the
    # run stayed within the budget
    gpu_bytes = result.summary["devices"][0]["bytes"]
    assert gpu_bytes + result.plan["reserve"]["0"] <= GPU_BUDGET - 256 * 2**10
    peak = result.figures["peak_gpu_bytes"]["0"]
    assert gpu_bytes + result.plan["reserve"]["0"] < peak <= GPU_BUDGET
    assert references == [fake.device(0)]  # the reference computed on the GPU, as the run did


def test_a_reference_larger_than_the_gpus_free_memory_computes_on_the_cpu(tmp_path, fake_gpu, capsys):
    import torch

    from offload_core.runner.modes.generate import reference_model
    from offload_core.testing import tiny_tied_llama

    tiny_tied_llama(tmp_path / "ckpt")
    size = sum(
        p.numel() * p.element_size()
        for p in torch.nn.Module.parameters(
            reference_model(tmp_path / "ckpt", "causal_lm", torch.float32, torch.device("cpu"))
        )
    )
    roomy = fake_gpu(count=2, memory=4 * size)
    assert next(
        reference_model(tmp_path / "ckpt", "causal_lm", torch.float32, roomy.device(1)).parameters()
    ).device == roomy.device(1)
    assert "cpu" not in capsys.readouterr().out
    tight = fake_gpu(count=1, memory=size)  # 90% of its free memory cannot hold the model
    model = reference_model(tmp_path / "ckpt", "causal_lm", torch.float32, tight.device(0))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert "the reference computes on the cpu" in capsys.readouterr().out


def test_the_copy_probe_fits_a_small_gpu(fake_gpu):
    """The host-to-device probe copies 64 MiB where the GPU has room, and a quarter of its free memory where not
    (a fresh calibration on an 8 MiB GPU ran out of memory)."""
    from offload_core.runner.plan.calibrate import h2d_bandwidth

    fake = fake_gpu(count=1, memory=8 * 2**20)
    assert h2d_bandwidth(fake.device(0)) > 0
    assert fake.memory_allocated(0) == 0  # the probe's buffers are given back
