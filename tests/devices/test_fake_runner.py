"""A whole run on a fake GPU: the plan holds back the headroom and the policy's blocks in flight on the GPU, the
run stays inside the GPU budget, and compare_in_memory runs the reference where the run computes."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from offload_core.runner.job import run
from offload_core.runner.config import register_configs

from tests import ROOT

GPU_BUDGET = 2 * 2**20


@pytest.mark.slow  # a whole run (the runner's job), a few seconds each
@pytest.mark.parametrize(
    "hook,storage",
    [("prefetch", "pinned_cpu"), ("prefetch", "memmap"), ("align_per_call", "safetensors"), ("chained", "pinned_cpu")],
)
def test_a_run_on_a_gpu_stays_in_its_budget_and_compares_on_the_gpu(hook, storage, tmp_path, fake_gpu, monkeypatch):
    from offload_core.jobs import generate

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


@pytest.mark.slow  # two whole runs
def test_the_plan_holds_the_math_libraries_workspace_whole_beside_the_budget(tmp_path, fake_gpu):
    """A GPU whose first matrix product takes a workspace (cuBLAS's 32 MiB on an H200, which took the small preset
    1.1 MiB over a 96 MiB budget when the plan held it within a quarter of the budget): a budget larger by the
    workspace plans the same GPU bytes, and the run, workspace included, stays within it."""
    workspace = 3 * GPU_BUDGET  # more than the whole budget: a quarter of it cannot hide it
    overrides = ["model=synthetic", "hook=prefetch", "storage=pinned_cpu", "max_new_tokens=4", "progress=false"]
    register_configs()
    results = []
    for space in (0, workspace):
        fake_gpu(count=1, memory=8 * GPU_BUDGET, workspace=space)
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            cfg = compose(config_name="config", overrides=[*overrides, f"+max_memory.0={GPU_BUDGET + space}"])
        results.append(run(cfg, output_dir=tmp_path / str(space)))
    plain, held = results
    assert held.summary["devices"][0]["bytes"] == plain.summary["devices"][0]["bytes"] > 0
    assert held.plan["reserve"]["0"] == plain.plan["reserve"]["0"]
    assert workspace < held.figures["peak_gpu_bytes"]["0"] <= GPU_BUDGET + workspace
    assert held.token_ids == plain.token_ids


def test_the_workspace_is_held_whole_on_a_gpu_and_not_on_the_cpu(fake_gpu):
    from offload_core.devices.torch_backend import cublas_workspace_bytes
    from offload_core.planning.headroom import runtime_slack

    fake = fake_gpu(count=1, workspace=5 * 2**20)
    # the workspace, and a quarter of what it leaves
    assert runtime_slack(9 * 2**20, fake.device(0)) == 2**20 + 5 * 2**20
    assert runtime_slack(4 * 2**20, "cpu") == runtime_slack(4 * 2**20) == 2**20
    assert cublas_workspace_bytes((9, 0), None) == 32 * 2**20  # torch's default from Hopper on
    assert cublas_workspace_bytes((8, 0), None) == 4096 * 2 * 1024 + 16 * 8 * 1024
    assert cublas_workspace_bytes((9, 0), ":4096:2") == 8 * 2**20


def test_a_reference_larger_than_the_gpus_free_memory_computes_on_the_cpu(tmp_path, fake_gpu, capsys):
    import torch

    from offload_core.jobs.generate import reference_model
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
    from offload_core.plan.calibrate import h2d_bandwidth

    fake = fake_gpu(count=1, memory=8 * 2**20)
    assert h2d_bandwidth(fake.device(0)) > 0
    assert fake.memory_allocated(0) == 0  # the probe's buffers are given back


def _mixtral(path):
    """A bf16 Mixtral whose decoder layers are each about a sixth of it: three in flight are more than a quarter."""
    import torch
    import transformers

    config = transformers.MixtralConfig(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=1000,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.slow  # a whole run (the runner's job), a few seconds each
@pytest.mark.parametrize("storage", ["pinned_cpu", "safetensors"])
def test_a_gpu_budget_that_cannot_hold_the_read_ahead_reads_less_ahead_and_stays_in_it(
    storage, tmp_path, fake_gpu, capsys
):
    """Seen on an H200: prefetch held three 206 MB Mixtral layers in flight on a 0.65 GB budget, warned, and peaked at
    0.71 GB. The plan now reads fewer blocks ahead until they fit, and says so."""
    total = _mixtral(tmp_path / "moe")
    budget = total // 4
    fake_gpu(count=1, memory=8 * total)
    register_configs()
    overrides = [
        "model=local",
        "model.tokenizer=bytes",
        f"model.path={tmp_path / 'moe'}",
        "hook=prefetch",
        f"storage={storage}",
        "max_new_tokens=3",
        "progress=false",
        "compare_in_memory=true",
        f"+max_memory.0={budget}",
        f"max_memory.cpu={2 * total + 64 * 2**20}",  # the host also holds the pinned staging ring (48 MiB)
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    result = run(cfg, output_dir=tmp_path / "run")
    assert result.matches_in_memory is True
    lightened = result.plan["lightened"]
    assert lightened.startswith("hook.depth=") and f"  {lightened}" in capsys.readouterr().out
    assert result.plan["reserve"]["0"] <= budget
    assert result.figures["peak_gpu_bytes"]["0"] <= budget
    # a budget that holds the read-ahead as configured changes nothing
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[*overrides[:-2], f"+max_memory.0={2 * total}", "plan_only=true"])
    assert run(cfg, output_dir=tmp_path / "roomy").plan["lightened"] == ""


def test_from_pretrained_loads_the_policy_its_plan_lightened(tmp_path, fake_gpu):
    from offload_core import from_pretrained

    total = _mixtral(tmp_path / "moe")
    fake = fake_gpu(count=1, memory=8 * total)
    model = from_pretrained(
        tmp_path / "moe",
        offload={"storage": "pinned_cpu", "policy": "prefetch", "execution_device": fake.device(0)},
        max_memory={0: total // 4, "cpu": 2 * total},
    )
    try:
        plan = model.offload_plan
        assert plan.lightened.startswith("hook.depth=") and plan.reserve[0] <= total // 4
        depth = int(plan.lightened.split(":")[0].removeprefix("hook.depth="))
        assert plan.policy.config.depth == depth < 2
        assert model.offload_state.handle.prefetcher.depth == depth  # what runs is what was planned
    finally:
        model.offload_state.remove()
