"""A pipeline's activations planned before loading: traced on fake tensors they equal what a real call's tensors
hold; ``headroom=auto`` holds them (and the runtime's slack) back from the budget, growing with the image; a
pipeline that cannot be traced is planned with the fixed headroom and one warning; the empty pipeline is left as it
was."""

from __future__ import annotations

import logging
import platform
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

import offload_core
from offload_core.errors import ConfigError
from offload_core.loading.pipeline import ENTRY_METHODS, build_empty_pipeline
from offload_core.loading.pipeline_memory import LiveBytes, pipeline_headroom, trace_activations
from offload_core.planning.headroom import FORWARD_HEADROOM, runtime_slack
from offload_core.runner.config import register_configs
from offload_core.runner.job import run

from tests import ROOT
from tests.logs import records_of
from tests.pipelines.conftest import CALL, images


def test_live_bytes_count_a_storage_once_and_free_it_with_its_last_view():
    with LiveBytes() as live:
        a = torch.ones(1000)  # 4000 bytes
        view = a[:10]  # the same storage
        b = a * 2
        del a  # the view still holds it
        c = b + 1  # three storages: the peak
        del view, b
        d = c * 3
    assert live.peak == 12_000 and live.live == 8_000
    del c, d


def _real_peak(pipeline_dir) -> int:
    """The largest bytes a real in-memory call's component calls hold (inputs and what they make), by the same
    count the trace uses."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(pipeline_dir, torch_dtype=torch.float32)
    peaks = [0]
    for component in (pipeline.text_encoder, pipeline.unet, pipeline.vae):
        for method in ("forward", *ENTRY_METHODS):
            original = getattr(component, method, None)
            if callable(original):

                def counted(*args, _original=original, **kwargs):
                    inputs = sum(t.untyped_storage().nbytes() for t in (*args, *kwargs.values()) if torch.is_tensor(t))
                    with LiveBytes() as live:
                        out = _original(*args, **kwargs)
                    peaks[0] = max(peaks[0], inputs + live.peak)
                    return out

                setattr(component, method, counted)
    images(pipeline)
    return peaks[0]


def test_the_trace_holds_what_a_real_call_holds_and_leaves_the_empty_pipeline_as_it_was(pipeline_dir):
    empty = build_empty_pipeline(pipeline_dir)
    call = {key: value for key, value in CALL.items()}
    traced = trace_activations(empty, call)
    assert traced == _real_peak(pipeline_dir)
    assert all(p.device.type == "meta" for p in empty.modules.parameters())
    assert not any(method in m.__dict__ for m in empty.modules.children() for method in ("forward", *ENTRY_METHODS))
    # the image's area and the batch: more of both, more activations
    assert trace_activations(empty, {**call, "height": 32, "width": 32}) > traced
    assert trace_activations(empty, {**call, "prompt": [CALL["prompt"]] * 3}) > traced


def test_a_pipeline_that_cannot_be_traced_gets_the_fixed_headroom_and_one_warning(pipeline_dir, monkeypatch):
    from diffusers import UNet2DConditionModel

    forward = UNet2DConditionModel.forward

    def data_dependent(self, sample, *args, **kwargs):
        if float(sample.abs().max()) > 1e9:  # a value read on the host: fake tensors have none
            sample = sample / 2
        return forward(self, sample, *args, **kwargs)

    monkeypatch.setattr(UNet2DConditionModel, "forward", data_dependent)
    empty = build_empty_pipeline(pipeline_dir)
    with records_of("offload_core.loading.pipeline_memory", logging.WARNING) as said:
        held = pipeline_headroom(empty, dict(CALL), 10**9)
    assert held == FORWARD_HEADROOM + runtime_slack(10**9, pipeline=True)
    assert (
        len(said) == 1 and said[0].startswith("could not trace the pipeline's activations (") and "headroom=" in said[0]
    )
    assert all(p.device.type == "meta" for p in empty.modules.parameters())


def _plan(pipeline_dir, tmp_path, *overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[f"model.path={pipeline_dir}", "model=local", "plan_only=true", *overrides],
        )
    return run(cfg, output_dir=tmp_path, plot=False)


@pytest.mark.slow  # two plans by the runner's job, each tracing a call of 20 steps
def test_run_py_holds_the_calls_activations_beside_the_weights(pipeline_dir, tmp_path):
    budget = 6_000_000
    small = _plan(pipeline_dir, tmp_path / "16", f"max_memory.cpu={budget}", "pipeline.height=16", "pipeline.width=16")
    large = _plan(pipeline_dir, tmp_path / "48", f"max_memory.cpu={budget}", "pipeline.height=48", "pipeline.width=48")
    empty = build_empty_pipeline(pipeline_dir)
    call = {"prompt": ["a photo of a red cat"], "num_inference_steps": 20, "guidance_scale": 7.5, "output_type": "pt"}
    for result, size in ((small, 16), (large, 48)):
        traced = trace_activations(empty, {**call, "height": size, "width": size})
        assert result.plan["headroom"] == traced + runtime_slack(budget, pipeline=True)
        assert result.summary["devices"]["cpu"]["bytes"] <= budget - result.plan["headroom"]
    assert large.plan["headroom"] > small.plan["headroom"]


def test_from_pretrained_holds_the_planned_calls_activations_and_gives_the_in_memory_images(pipeline_dir, reference):
    budget = 1_000_000
    pipeline = offload_core.from_pretrained(
        pipeline_dir, offload={"policy": "prefetch"}, max_memory={"cpu": budget}, plan_call={"height": 16, "width": 16}
    )
    plan = pipeline.offload_modules.offload_plan
    try:
        assert torch.equal(images(pipeline), reference)
    finally:
        pipeline.offload_state.remove()
    traced = trace_activations(
        build_empty_pipeline(pipeline_dir), {"prompt": "a", "num_inference_steps": 2, "height": 16, "width": 16}
    )
    assert plan.headroom == traced + runtime_slack(budget, pipeline=True)
    assert plan.summary["devices"]["cpu"]["bytes"] <= budget - plan.headroom


def test_plan_call_is_refused_for_a_transformers_checkpoint(tmp_path):
    from offload_core.testing import tiny_tied_llama

    tiny_tied_llama(tmp_path)
    with pytest.raises(ConfigError, match="^plan_call plans a diffusers pipeline's call; .* drop it$"):
        offload_core.from_pretrained(tmp_path, plan_call={"height": 16})


#: run in a fresh process (a test worker's heap holds free chunks that serve any size first)
_GIVES_BACK = """
import sys, torch, psutil
from offload_core.loading.pipeline import build_empty_pipeline
raised = torch.ones(30 << 20, dtype=torch.uint8)  # mapped; freeing it raises glibc's own threshold to 30 MiB
del raised
if sys.argv[2] == "build":
    build_empty_pipeline(sys.argv[1])
before = psutil.Process().memory_info().rss
activation = torch.ones(24 << 20, dtype=torch.uint8)  # under 30 MiB: glibc's heap would serve it and keep it
del activation
print((psutil.Process().memory_info().rss - before) >> 20)
"""


@pytest.mark.slow  # two processes
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_once_a_pipeline_is_built_a_freed_activation_goes_back_to_the_system(pipeline_dir):
    kept = {}
    for case in ("build", "none"):
        done = subprocess.run(
            [sys.executable, "-c", _GIVES_BACK, str(pipeline_dir), case], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        kept[case] = int(done.stdout.split()[-1])
    assert kept["build"] < 4 and kept["none"] >= 20, kept  # MiB still resident after the 24 MiB were freed


def test_a_budget_too_small_for_its_call_holds_back_half_and_says_so(pipeline_dir):
    with records_of("offload_core.loading.pipeline_memory", logging.WARNING) as said:
        pipeline = offload_core.from_pretrained(
            pipeline_dir, offload={"policy": "chained"}, max_memory={"cpu": 150_000}
        )
    plan = pipeline.offload_modules.offload_plan
    pipeline.offload_state.remove()
    assert plan.headroom == 75_000 and {"cpu", "disk"} <= set(pipeline.hf_device_map.values())
    assert len(said) == 1 and "over half of its budget" in said[0] and "headroom=<size>" in said[0]
