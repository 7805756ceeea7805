"""run(cfg) with page_cache: the plan shows the kept and streamed bytes, metrics.json the disk reads and the kept set's
figures."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from offload_core.errors import ConfigError
from offload_core.runner.job import run
from offload_core.jobs.disk_reads import DiskReads
from offload_core.storage.residency import page_cache_plan, page_cache_setting
from offload_core.runner.config import register_configs

from tests import ROOT

CPU = torch.device("cpu")
SUMMARY = {"devices": {"cpu": {"bytes": 100}, "disk": {"bytes": 1000}}}


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_page_cache_setting_reads_auto_lru_and_sizes():
    assert page_cache_setting("auto") is None and page_cache_setting("lru") == "lru"
    assert page_cache_setting("0") == 0 and page_cache_setting("1KiB") == 1024
    with pytest.raises(ConfigError, match="page_cache"):
        page_cache_setting("lots")


def test_the_plan_predicts_disk_reads_from_the_kept_set():
    plan = page_cache_plan("400", SUMMARY, CPU, keeps=True)
    assert plan["kept_bytes"] == 400 and plan["streamed_bytes"] == 600 and plan["predicted_disk_bytes_per_token"] == 600
    auto = page_cache_plan(
        "auto", SUMMARY, CPU, keeps=True, anon_budget=50, largest_block=10, available=lambda: (1 << 30) + 300
    )
    assert auto["kept_bytes"] == 210  # available less the run's budget, the 1 GiB margin and 4 streamed blocks
    assert page_cache_plan("400", SUMMARY, CPU, keeps=False) == {"page_cache": "lru", "offloaded_bytes": 1000}


@pytest.mark.slow  # a whole run
def test_a_run_with_page_cache_zero_streams_every_block_and_reports_disk_reads(tmp_path, capsys):
    cfg = _cfg(
        [
            "model=synthetic",
            "storage=memmap",
            "hook=prefetch",
            f"offload_folder={tmp_path / 'off'}",
            "max_memory.cpu=1MiB",
            "headroom=0",
            "max_new_tokens=3",
            "page_cache=0",
            "progress=false",
        ]
    )
    result = run(cfg, output_dir=tmp_path)
    assert "page cache: kept set 0 B" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["prefetch"]["kept_blocks"] == 0 and metrics["prefetch"]["streamed_blocks"] > 0
    # Nothing kept: every forward reads every offloaded byte and drops it after use, no more and no less.
    assert metrics["bytes_moved_per_token"] == metrics["offloaded_bytes"] > 0
    assert metrics["prefetch"]["dropped_bytes"] == metrics["generated_tokens"] * metrics["offloaded_bytes"]
    assert "disk_read_bytes_per_token" in metrics and metrics["read_bandwidth_bytes_per_s"] >= 0
    assert result.plan["page_cache"]["predicted_disk_bytes_per_token"] == result.plan["page_cache"]["offloaded_bytes"]


def test_disk_reads_are_sampled_per_forward_and_the_first_reported_apart():
    model = torch.nn.Linear(2, 2)
    with DiskReads(model) as reads:
        for _ in range(3):
            model(torch.ones(2))
    figures = reads.figures()
    if not figures:
        pytest.skip("this platform does not report the process's read_bytes")
    assert len(reads.marks) == 5
    assert figures["disk_read_bytes_first_token"] >= 0 and figures["disk_read_bytes_per_token"] >= 0
    each = figures["disk_read_bytes_by_token"]
    assert len(each) == 3 and each[0] == figures["disk_read_bytes_first_token"]
    assert sum(each[1:]) == 2 * figures["disk_read_bytes_per_token"]
    model(torch.ones(2))
    assert len(reads.marks) == 5, "the sampling module hook was left on the model"
