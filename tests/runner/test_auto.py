"""auto=true: the options a user gave stay fixed and the rest are chosen; the ranked table is written (auto.json,
auto.csv) and printed, and its first row is what runs; a strategy that does not declare itself stays out; the
dispatched probe that the prediction reads runs on a tiny model and counts tensors brought in."""

from __future__ import annotations

import csv
import json

import pytest

from offload_core.runner.job import run
from offload_core.plan.auto import given_options

TINY = ["model=synthetic", "progress=false", "max_new_tokens=4", "max_memory.cpu=1MiB", "headroom=0"]


def test_given_options_are_read_from_the_override_list():
    assert given_options(["storage=memmap", "hook.depth=1", "+page_cache=0", "model=synthetic", "~x"]) == {
        "storage",
        "hook",
        "page_cache",
        "model",
        "x",
    }


def test_plan_only_auto_keeps_what_was_given_ranks_the_rest_and_writes_the_table(tmp_path, compose_run, capsys):
    overrides = [*TINY, "hook=align_per_call", "plan_only=true", "auto=true"]
    result = run(compose_run(overrides), output_dir=tmp_path, labels={"overrides": overrides}, plot=False)
    table = json.loads((tmp_path / "auto.json").read_text())
    out = capsys.readouterr().out
    assert {row["configuration"].split()[1] for row in table} == {"hook=align_per_call"}  # kept as given
    stores = {row["configuration"].split()[0] for row in table}
    assert {"storage=memmap", "storage=safetensors"} <= stores  # chosen among
    runnable = [row for row in table if not row["problem"]]
    assert [row["rank"] for row in table] == list(range(1, len(table) + 1))
    assert [row["predicted_total_s"] for row in runnable] == sorted(row["predicted_total_s"] for row in runnable)
    assert runnable and runnable[0] is table[0]
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert table[0]["configuration"].startswith(f"storage={written['choices']['storage']} hook=align_per_call")
    assert written["auto"] == table[0]["configuration"] and result.figures["plan_only"]
    assert "auto: " in out and "kept as given: hook" in out and table[0]["configuration"] in out
    with open(tmp_path / "auto.csv", newline="") as f:
        assert [row["configuration"] for row in csv.DictReader(f)] == [row["configuration"] for row in table]


def test_a_strategy_that_does_not_declare_itself_stays_out_of_auto(compose_run, tmp_path):
    from offload_core.registry.manager import get_registry
    from offload_core.plan.auto import candidates
    from offload_core.runner.settings import read_settings

    settings = read_settings(compose_run([*TINY, "auto=true", "storage=memmap"]), tmp_path)
    tried = candidates(settings, {"storage"}, 1)
    hooks = {c.hook["name"] for c in tried}
    registry = get_registry()
    assert hooks == {n for n in registry.names("policy") if registry.get("policy", n).factory.auto}
    assert {"align_per_call", "prefetch", "experts"} <= hooks
    assert sorted(c.hook.get("depth") for c in tried if c.hook["name"] == "prefetch") == [1, 2]
    assert {c.storage["name"] for c in tried} == {"memmap"}  # given: kept
    with_prompts = read_settings(compose_run([*TINY, "auto=true", "prompts=bench/prompts.txt"]), tmp_path)
    assert {c.batch_size for c in candidates(with_prompts, {"storage", "hook"}, 3)} == {1, 2}
    assert {c.batch_size for c in candidates(with_prompts, {"storage", "hook", "batch_size"}, 3)} == {1}


def test_the_dispatched_probe_counts_tensors_brought_in_and_its_fixed_costs(tmp_path, compose_run):
    from offload_core.registry.manager import get_registry
    from offload_core.plan.model import open_model
    from offload_core.plan.probe import PROBE_BLOCKS, probe_times

    run_model = open_model({"name": "synthetic", "preset": "tiny"}, None)
    registry = get_registry()
    import torch

    terms = probe_times(
        run_model,
        registry.create("storage", "safetensors", {"name": "safetensors"}),
        registry.create("policy", "align_per_call", {"name": "align_per_call"}),
        torch.device("cpu"),
        1,
        8,
        tmp_path,
    )
    block = next(m for m in run_model.model.modules() if type(m).__name__ in run_model.no_split)
    assert terms["loads_per_forward"] == PROBE_BLOCKS * len(list(block.parameters()))
    assert terms["per_load_decode_s"] >= 0 and terms["outside_decode_s"] > 0 and terms["first_call_s"] >= 0
    assert terms["probe_tensors"] > PROBE_BLOCKS * len(list(block.parameters())) and terms["probe_load_s"] > 0
    assert 0 < terms["probe_offloaded_bytes"] < terms["probe_bytes"]
    assert not list(tmp_path.iterdir())  # its files are removed


def test_the_prediction_adds_the_probe_terms_per_tensor_loaded():
    import torch

    from offload_core.plan.predict import predict_time

    class Plan:
        summary = {"devices": {"cpu": {"bytes": 10, "tensors": 1}, "disk": {"bytes": 10, "tensors": 9}}}
        page_cache = {"predicted_disk_bytes_per_token": 0}
        predicted_bytes_per_token = 10
        predicted_loads_per_token = 9

    class Storage:
        reads_from, pinned = "offload_folder", False

    class Policy:
        overlaps_io = False

    disk = {"write_bps": 1e9, "cold_read_bps": 1e9, "warm_read_bps": 1e9}
    calibration = {
        "checkpoint": disk,
        "offload_folder": disk,
        "compute": {"prefill": {"block_s": 0.01}, "decode": {"block_s": 0.001}},
    }
    bare = predict_time(4, Plan(), Storage(), Policy(), torch.device("cpu"), calibration)
    probe = {
        "outside_prefill_s": 0.02,
        "outside_decode_s": 0.002,
        "per_load_prefill_s": 0.001,
        "per_load_decode_s": 0.0005,
        "first_call_s": 0.1,
        "loads_per_forward": 18,
        "probe_load_s": 0.05,
        "probe_tensors": 20,
        "probe_bytes": 0,
        "probe_offloaded_bytes": 0,
    }
    probed = predict_time(4, Plan(), Storage(), Policy(), torch.device("cpu"), {**calibration, "probe": probe})
    assert bare["predicted_step_s"] == pytest.approx(0.004)
    assert probed["predicted_step_s"] == pytest.approx(0.004 + 0.002 + 9 * 0.0005)
    assert probed["predicted_ttft_s"] == pytest.approx(0.04 + 0.02 + 9 * 0.001 + 0.1)
    # loading's fixed cost per tensor: 10 tensors at 0.05 s / 20
    assert probed["predicted_load_s"] == pytest.approx(bare["predicted_load_s"] + 10 * 0.05 / 20)
    here = predict_time(
        4, Plan(), Storage(), Policy(), torch.device("cpu"), {**calibration, "probe": probe, "probed_here": True}
    )
    assert here["predicted_ttft_s"] == pytest.approx(0.04 + 0.02 + 9 * 0.001)  # the warm-up was paid by the probe


def test_the_first_token_pays_once_for_the_offloaded_weights_it_is_the_first_to_reach():
    import torch

    from offload_core.plan.predict import predict_time

    class Plan:
        summary = {"devices": {"cpu": {"bytes": 10}, "disk": {"bytes": 10**7}}}
        page_cache = {"predicted_disk_bytes_per_token": 0}
        predicted_bytes_per_token = 10**7
        predicted_loads_per_token = 0

    class Storage:
        def __init__(self, reads_from):
            self.reads_from, self.pinned = reads_from, False

    class Policy:
        overlaps_io = False

    disk = {"write_bps": 1e9, "cold_read_bps": 1e9, "warm_read_bps": 1e10, "first_touch_bps": 1e10}
    calibration = {
        "checkpoint": disk,
        "offload_folder": disk,
        "compute": {"prefill": {"block_s": 0.01}, "decode": {"block_s": 0.001}},
    }
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    mapped = predict_time(4, Plan(), Storage("checkpoint"), Policy(), cpu, calibration)
    assert mapped["predicted_first_touch_s"] == pytest.approx(1e-3)  # 10 MB at 10 GB/s, faulted in once
    assert mapped["predicted_ttft_s"] == pytest.approx(0.04 + 1e-3)
    assert mapped["predicted_step_s"] == pytest.approx(0.004)
    half_cold = {**calibration, "checkpoint": {**disk, "cached_share": 0.5}}
    cold = predict_time(4, Plan(), Storage("checkpoint"), Policy(), cpu, half_cold)
    assert cold["predicted_first_touch_s"] == pytest.approx(1e-3 + 5e6 / 1e9)  # the uncached half from the disk
    assert cold["predicted_step_s"] == mapped["predicted_step_s"]  # read once: later tokens find it cached
    assert cold["predicted_load_s"] == pytest.approx(mapped["predicted_load_s"] + 5 / 1e9 - 5 / 1e10)
    held = predict_time(4, Plan(), Storage("memory"), Policy(), cpu, calibration)
    assert held["predicted_first_touch_s"] == 0 and held["predicted_ttft_s"] == pytest.approx(0.04)
    assert (
        predict_time(4, Plan(), Storage("checkpoint"), Policy(), gpu, {**calibration, "h2d_bps": 1e12})[
            "predicted_first_touch_s"
        ]
        == 0
    )  # a GPU run's copies read the pages: in its copy time


@pytest.mark.slow  # the runner's job with auto=true on two models: each configuration it ranks calibrated
def test_the_experts_policy_is_predicted_for_its_routed_experts_and_left_out_for_a_dense_model(compose_run, tmp_path):
    from offload_core.module_hooks.experts.lists import routed_shares
    from offload_core.plan.model import open_model
    from offload_core.plan.run_plan import make_plan
    from offload_core.runner.settings import build_strategies, read_settings
    from tests.speculative.models import mixtral

    moe = mixtral(tmp_path / "moe")
    common = [
        "model=local",
        "model.tokenizer=bytes",
        f"model.path={moe}",
        "progress=false",
        "max_new_tokens=2",
        "headroom=0",
    ]
    moved = {}
    for hook in ("prefetch", "experts"):
        overrides = [*common, "max_memory.cpu=1KiB", "over_budget=warn", f"hook={hook}"]  # 1 KiB: all on disk
        settings = read_settings(compose_run(overrides), tmp_path / hook)
        run_model = open_model(settings.model, settings.dtype)
        from offload_core.loading.checkpoint import Checkpoint

        with Checkpoint.open(run_model.checkpoint_dir) as checkpoint:
            moved[hook] = make_plan(settings, build_strategies(settings), run_model, checkpoint)
    shares = routed_shares(run_model.model)
    experts = sum(p.numel() * p.element_size() for n, p in run_model.model.named_parameters() if n in shares)
    assert shares and {share for share, _ in shares.values()} == {2 / 4}  # top-2 of 4 experts
    # every expert offloaded: experts reads the routed half of them, prefetch all of them
    saved = moved["prefetch"].predicted_bytes_per_token - moved["experts"].predicted_bytes_per_token
    assert saved == pytest.approx(experts / 2, rel=0.01)
    # each fused expert tensor read as two routed rows instead of once whole
    extra = moved["experts"].predicted_loads_per_token - moved["prefetch"].predicted_loads_per_token
    assert extra == sum(reads - 1 for _, reads in shares.values()) == len(shares)
    # auto=true ranks experts among the MoE's candidates; a dense model's table leaves it out
    out = tmp_path / "auto-moe"
    run(
        compose_run([*common, "max_memory.cpu=200KiB", "storage=safetensors", "plan_only=true", "auto=true"]),
        output_dir=out,
        plot=False,
    )
    assert any("hook=experts" in row["configuration"] for row in json.loads((out / "auto.json").read_text()))
    dense = tmp_path / "auto-dense"
    run(compose_run([*TINY, "storage=safetensors", "plan_only=true", "auto=true"]), output_dir=dense, plot=False)
    assert not any("hook=experts" in row["configuration"] for row in json.loads((dense / "auto.json").read_text()))


def test_the_first_touch_rate_is_measured_on_the_cached_pages_of_the_file_itself(tmp_path):
    import os

    from offload_core.plan.first_touch import file_pages
    from offload_core.plan.predict import with_checkpoint_pages

    shard = tmp_path / "model.safetensors"
    shard.write_bytes(os.urandom(8 * 2**20))
    os.sync()
    with open(shard, "rb") as f:
        f.read()  # in the page cache
        cached = file_pages([shard, tmp_path / "missing.safetensors"])
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if not cached:
        pytest.skip("no mincore here")
    assert cached["first_touch_bps"] > 0 and cached["cached_share"] == 1
    assert file_pages([shard]) == {"cached_share": 0}  # not cached: its first touch is a read from the disk
    assert file_pages([]) == {}
    calibration = {"checkpoint": {"first_touch_bps": 1.0, "warm_read_bps": 2.0}, "compute": {}}
    cold = with_checkpoint_pages(calibration, tmp_path)["checkpoint"]
    assert cold["first_touch_bps"] == 1.0 and cold["cached_share"] == 0  # nothing cached to time: the rate kept
    shard.read_bytes()
    measured = with_checkpoint_pages(calibration, tmp_path)["checkpoint"]
    assert measured["first_touch_bps"] > 1.0 and measured["cached_share"] == 1 and measured["warm_read_bps"] == 2.0
    assert calibration["checkpoint"] == {"first_touch_bps": 1.0, "warm_read_bps": 2.0}  # the cached one unchanged
