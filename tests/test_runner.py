"""The runner end to end: the main job on SmolLM2 with part of it on disk answers like the in-memory model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from offload_core.runner.settings import register_configs
from offload_core.runner.job import run

ROOT = Path(__file__).resolve().parent.parent


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("main_job")
    cfg = _cfg(["compare_in_memory=true", "progress=false", "max_new_tokens=12"])
    return run(cfg, output_dir=out), out


def test_main_job_answers_paris_with_weights_on_disk(main_job):
    result, out = main_job
    assert "Paris" in result.text
    assert result.matches_in_memory is True
    devices = result.summary["devices"]
    assert devices["disk"]["bytes"] > 0 and devices["cpu"]["bytes"] > 0
    assert result.figures["bytes_moved_per_token"] > 0


def test_main_job_writes_its_files(main_job):
    result, out = main_job
    device_map = json.loads((out / "device_map.json").read_text())
    assert device_map == result.device_map
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("prompt", "text", "token_ids", "load_s", "time_to_first_token_s", "decode_tokens_per_s",
                "peak_anon_rss_bytes", "peak_file_rss_bytes", "bytes_moved_per_token"):
        assert key in metrics, key
    assert metrics["token_ids"] == result.token_ids
    assert metrics["text"] == result.text


def test_budget_is_used_and_reported(main_job):
    result, _ = main_job
    cpu = result.summary["devices"]["cpu"]
    # 200 MiB budget, 48 MiB headroom, no reservation needed for a zero-copy mapped read on CPU.
    assert cpu["bytes"] <= 200 * 2**20 - 48 * 2**20
    assert cpu["bytes"] > 0.6 * (200 - 48) * 2**20
    assert result.plan["reserve"] == {"cpu": 0}


def test_plan_only_loads_nothing(tmp_path):
    cfg = _cfg(["plan_only=true", "model=synthetic", "storage=memmap", f"offload_folder={tmp_path / 'off'}",
                "max_memory.cpu=1MiB", "headroom=0"])
    result = run(cfg, output_dir=tmp_path)
    assert result.token_ids == [] and "disk" in set(result.device_map.values())
    assert not (tmp_path / "off").exists()
    assert (tmp_path / "placement.png").stat().st_size > 1000
    assert result.plan["predicted_bytes_per_token"] > 0
    quiet = run(cfg, output_dir=tmp_path / "no_plot", plot=False)  # the benchmark's way to get the plan
    assert quiet.device_map == result.device_map and not (tmp_path / "no_plot" / "placement.png").exists()


def test_user_device_map_file(tmp_path):
    mapping = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
               "model.layers.3": "cpu", "model.norm": "cpu", "lm_head": "disk"}
    path = tmp_path / "map.json"
    path.write_text(json.dumps(mapping))
    cfg = _cfg([f"device_map={path}", "model=synthetic", "progress=false", "max_new_tokens=4", "compare_in_memory=true"])
    result = run(cfg, output_dir=tmp_path)
    assert result.device_map == mapping
    assert result.matches_in_memory is True
    assert result.figures["offloaded_bytes"] > 0


def test_run_py_main_job_subprocess(tmp_path):
    """`python run.py` as a user runs it: exit 0, the answer printed, files in Hydra's run folder."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), f"hydra.run.dir={tmp_path}", "progress=false", "max_new_tokens=10"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    assert "disk:" in proc.stdout
    assert (tmp_path / "metrics.json").exists() and (tmp_path / "device_map.json").exists()


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash\n")[1:3]]
    assert blocks[0].endswith("python run.py")
    assert blocks[1].endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert blocks[1] in ci


def test_reservation_follows_store_and_policy():
    import torch

    from offload_core.registry.manager import get_registry
    from offload_core.runner.plan import reservation

    registry = get_registry()

    def make(group, name, **options):
        return registry.create(group, name, {"name": name, **options})

    safetensors, memmap, pinned = make("storage", "safetensors"), make("storage", "memmap"), make("storage", "pinned_cpu")
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    block, module = 1000, 100
    assert reservation(make("policy", "prefetch", depth=2), safetensors, cpu, block, module, converts=False) == {"cpu": 0}
    assert reservation(make("policy", "prefetch", depth=2, pool=True), memmap, cpu, block, module, converts=False) == {"cpu": 3000}
    # Only a store that converts on read makes copies of a checkpoint stored in another dtype.
    assert reservation(make("policy", "prefetch", depth=1), safetensors, cpu, block, module, converts=True) == {"cpu": 2000}
    assert reservation(make("policy", "prefetch", depth=1), memmap, cpu, block, module, converts=True) == {"cpu": 0}
    assert reservation(make("policy", "align_per_call"), safetensors, cpu, block, module, converts=True) == {"cpu": 100}
    assert reservation(make("policy", "align_per_call", granularity="block"), safetensors, cpu, block, module,
                       converts=True) == {"cpu": 1000}
    assert reservation(make("policy", "chained"), safetensors, gpu, block, module, converts=False) == {1: 1000}
    # A GPU run holds the blocks in flight on the device, and the staging ring in host memory
    # unless the store is already pinned.
    staged = reservation(make("policy", "prefetch", depth=2, staging_chunk="1MiB"), memmap, gpu, block, module, converts=False)
    assert staged == {1: 3000, "cpu": 3 * 2**20}
    assert reservation(make("policy", "prefetch", depth=2), pinned, gpu, block, module, converts=False) == {1: 3000, "cpu": 0}


def test_a_third_party_policy_declares_its_own_reservation():
    import torch

    from offload_core.module_hooks import InFlight, reserve_units
    from offload_core.registry.manager import as_contract

    class Greedy:  # written without the contract: keeps four blocks on the execution device, copies even on a CPU run
        def __init__(self, config):
            self.config = config

        def reserve(self, need):
            return reserve_units(need, need.block_bytes, 4, copies_on_cpu=True)

        def attach(self, model, context):
            raise NotImplementedError

    class Minimal:  # only the required method: every capability comes from the contract's defaults
        def attach(self, model, context):
            raise NotImplementedError

    need = InFlight(torch.device("cpu"), block_bytes=1000, module_bytes=100)
    assert as_contract("policy", "greedy", Greedy)(None).reserve(need) == {"cpu": 4000}
    minimal = as_contract("policy", "minimal", Minimal)(None)
    assert minimal.reserve(need) == {"cpu": 0}  # no reserve: one block, a view on a CPU run
    assert minimal.reserve(InFlight(torch.device("cuda", 0), 1000, 100)) == {0: 1000}
    assert (minimal.granularity, minimal.offload_buffers, minimal.predict_moved([3, 4]), minimal.own_device_map(None, None)) == (
        "block", False, 7, None)



def test_prefetch_pool_run_holds_its_reservation_and_matches(tmp_path):
    cfg = _cfg(["model=synthetic", "model.preset=small", "hook=prefetch", "hook.pool=true", "hook.depth=1",
                "storage=memmap", "max_memory.cpu=48MiB", "headroom=0", "progress=false", "max_new_tokens=4",
                "compare_in_memory=true"])
    result = run(cfg, output_dir=tmp_path)
    assert result.matches_in_memory is True
    block = result.plan["largest_block"]
    assert result.plan["reserve"] == {"cpu": 2 * block}
    assert 0 < result.summary["devices"]["cpu"]["bytes"] <= 48 * 2**20 - 2 * block
    assert result.figures["offloaded_bytes"] > 0
    prefetch = result.figures["prefetch"]  # also in metrics.json and printed
    assert prefetch["hits"] > prefetch["misses"] > 0 and prefetch["late"] <= prefetch["hits"]
