"""A pipeline folder through the runner (``model.path=<pipeline>``): images, metrics.json, the in-memory comparison;
and diffusers imported only when a pipeline folder is given."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from PIL import Image

from offload_core.runner.job import run
from offload_core.runner.config import register_configs

from tests import ROOT


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.slow
def test_run_writes_one_image_per_prompt_a_grid_and_the_figures(pipeline_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na blue dog\na cat on the dog\n")
    cfg = _cfg(
        [
            f"model.path={pipeline_dir}",
            "model=local",
            "hook=chained",
            "storage=safetensors",
            "max_memory.cpu=250000",
            "headroom=0",
            f"prompts={prompts}",
            "batch_size=2",
            "pipeline.height=16",
            "pipeline.width=16",
            "pipeline.num_inference_steps=2",
            "pipeline.negative_prompt=blue",
            "compare_in_memory=true",
            "progress=false",
        ]
    )
    out = tmp_path / "run"
    result = run(cfg, output_dir=out)
    assert result.matches_in_memory is True
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["images"] == 3 and metrics["steps"] == 4 and metrics["matches_in_memory"] is True
    assert metrics["bytes_moved"] > 0 and metrics["time_per_step_s"] > 0 and "peak_anon_rss_bytes" in metrics
    assert {key.split(".")[0] for key in json.loads((out / "device_map.json").read_text())} == {
        "text_encoder",
        "unet",
        "vae",
    }
    assert [Image.open(out / f"image-{i:03d}.png").size for i in range(3)] == [(16, 16)] * 3
    assert Image.open(out / "grid.png").size == (48, 16)


def test_plan_only_plans_the_pipeline_and_loads_nothing(pipeline_dir, tmp_path):
    # headroom=auto (the call's activations) is tested in test_pipeline_memory.py
    cfg = _cfg([f"model.path={pipeline_dir}", "model=local", "max_memory.cpu=150000", "headroom=0", "plan_only=true"])
    result = run(cfg, output_dir=tmp_path, plot=False)
    assert {"cpu", "disk"} <= set(result.device_map.values()) and not (tmp_path / "image.png").exists()
    assert any(key.startswith("unet.") or key == "unet" for key in result.device_map)


@pytest.mark.slow
def test_diffusers_is_imported_only_for_a_pipeline_folder(tmp_path):
    code = (
        "import sys, offload_core\n"
        "from offload_core.testing import tiny_tied_llama\n"
        "from offload_core.runner import job\n"
        f"tiny_tied_llama({str(tmp_path)!r})\n"
        f"offload_core.from_pretrained({str(tmp_path)!r}, {{'cpu': 100000}}, {{'headroom': 0}})\n"
        "print('diffusers' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
