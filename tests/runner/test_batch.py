"""Batched generation: the prompts file, left padding, the planned KV cache and the largest batch that fits, the time
prediction from a calibration; whole batched runs (every policy, outputs equal to memory in the same batches) are
slow."""

from __future__ import annotations

import io
import contextlib
import json
import re

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import LlamaConfig

from offload_core.errors import ConfigError
from offload_core.planning.batch_memory import batch_memory, largest_batch
from offload_core.runner.inputs import read_prompts
from offload_core.jobs.batch import left_padded, trim
from offload_core.plan.batches import Batches
from offload_core.runner.job import run
from offload_core.plan.predict import predict_time
from offload_core.planning.headroom import runtime_slack
from offload_core.runner.config import register_configs

from tests import ROOT


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def _prompts(tmp_path, lines):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prompts_file_plain_and_json_lines(tmp_path):
    path = _prompts(tmp_path, ["one", "", json.dumps({"prompt": "two", "id": 7}), "  three  "])
    assert read_prompts(path) == ["one", "two", "  three  "]
    with pytest.raises(ConfigError, match="line 2 is not a JSON object"):
        read_prompts(_prompts(tmp_path, ["ok", json.dumps({"text": "no prompt"})]))
    with pytest.raises(ConfigError, match="holds no prompt"):
        read_prompts(_prompts(tmp_path, ["", "  "]))
    with pytest.raises(ConfigError, match="cannot be read"):
        read_prompts(tmp_path / "missing.txt")


def test_left_padding_and_trimming():
    ids, mask = left_padded([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert trim([4, 2, 0, 0], eos={2}) == [4, 2] and trim([4, 5], eos={2}) == [4, 5]


def test_kv_cache_counts_layers_kv_heads_head_dim_and_tokens():
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=3,
        intermediate_size=128,
        vocab_size=100,
    )
    one = batch_memory(config, batch=1, prompt_tokens=10, new_tokens=6, dtype=torch.bfloat16)
    assert one.kv_cache == 2 * 3 * 2 * 8 * 16 * 2
    eight = batch_memory(config, batch=8, prompt_tokens=10, new_tokens=6, dtype=torch.bfloat16)
    assert eight.kv_cache == 8 * one.kv_cache == 24_576
    assert eight.activations == 8 * one.activations > 0
    fits = largest_batch(config, eight.total, 10, 6, torch.bfloat16, upto=64)
    assert fits == 8
    assert largest_batch(config, one.total - 1, 10, 6, torch.bfloat16, upto=64) == 0


@pytest.mark.slow  # four plans of a model
def test_a_batch_that_cannot_fit_names_the_largest_that_does(tmp_path):
    prompts = _prompts(tmp_path, [f"prompt number {i} " * 20 for i in range(64)])
    base = [
        "plan_only=true",
        "model=synthetic",
        "model.preset=small",
        "storage=memmap",
        f"prompts={prompts}",
        "max_memory.cpu=24MiB",
        "max_new_tokens=64",
        f"offload_folder={tmp_path / 'off'}",
    ]
    with pytest.raises(ConfigError, match=r"use batch_size=(\d+) or less") as caught:
        run(_cfg(base + ["batch_size=64"]), output_dir=tmp_path / "big", plot=False)
    assert "\n" not in str(caught.value)
    fits = int(re.search(r"batch_size=(\d+) or less", str(caught.value)).group(1))
    assert 1 <= fits < 64
    planned = run(_cfg(base + [f"batch_size={fits}"]), output_dir=tmp_path / "fits", plot=False)
    single = run(_cfg(base + ["batch_size=1"]), output_dir=tmp_path / "one", plot=False)
    # the batch's memory (beside the runtime's slack) is held back, and grows with the batch
    slack = runtime_slack(24 * 2**20)
    assert fits * (single.plan["headroom"] - slack) == planned.plan["headroom"] - slack > 0
    with pytest.raises(ConfigError, match=r"use batch_size="):
        run(_cfg(base + [f"batch_size={fits + 1}"]), output_dir=tmp_path / "over", plot=False)


class _Storage:
    def __init__(self, reads_from, pinned=False):
        self.reads_from, self.pinned = reads_from, pinned


class _Policy:
    def __init__(self, overlaps_io):
        self.overlaps_io = overlaps_io


class _Plan:
    def __init__(self, page_cache=None):
        self.summary = {"devices": {"cpu": {"bytes": 400}, "disk": {"bytes": 10**7}}}
        self.predicted_bytes_per_token = 10**7
        self.predicted_loads_per_token = 0
        self.page_cache = page_cache or {}


def _calibration(prefill=(0.05, 0.02), decode=(0.01, 0.005)):
    disk = {"write_bps": 1e9, "cold_read_bps": 1e8, "warm_read_bps": 1e9}
    return {
        "offload_folder": disk,
        "checkpoint": disk,
        "compute": {
            "prefill": {"block_s": prefill[0], "head_s": prefill[1]},
            "decode": {"block_s": decode[0], "head_s": decode[1]},
        },
    }


def test_prediction_counts_blocks_head_and_the_disk_reads_the_page_cache_plan_leaves():
    cpu = torch.device("cpu")
    streamed = _Plan({"predicted_disk_bytes_per_token": 10**7})  # every offloaded byte streamed: 0.1 s a forward
    serial = predict_time(4, streamed, _Storage("offload_folder"), _Policy(False), cpu, _calibration())
    assert serial["predicted_step_s"] == pytest.approx(0.145)  # 4 blocks of 10 ms, a 5 ms head, a 0.1 s read
    assert serial["predicted_ttft_s"] == pytest.approx(0.32)
    overlapped = predict_time(
        4, streamed, _Storage("offload_folder"), _Policy(True), cpu, _calibration(prefill=(0.1, 0.0))
    )
    assert overlapped["predicted_step_s"] == pytest.approx(0.1)  # the read hides the 0.045 s of compute
    assert overlapped["predicted_ttft_s"] == pytest.approx(0.4)  # the compute hides the read
    # kept in the page cache: a CPU run computes on the cached pages, nothing is read per forward
    kept = predict_time(
        4, _Plan({"predicted_disk_bytes_per_token": 0}), _Storage("offload_folder"), _Policy(False), cpu, _calibration()
    )
    assert kept["predicted_step_s"] == pytest.approx(0.045)
    cold = predict_time(
        4,
        _Plan({"predicted_disk_bytes_per_token": 0}),
        _Storage("checkpoint"),
        _Policy(False),
        cpu,
        _calibration(),
        cold=True,
    )
    assert cold["predicted_step_s"] == pytest.approx(0.145)
    assert predict_time(4, streamed, _Storage("memory"), _Policy(False), cpu, _calibration())[
        "predicted_step_s"
    ] == pytest.approx(0.045)
    assert predict_time(4, streamed, _Storage("memory"), _Policy(False), cpu, {"compute": {"prefill": {}}}) == {}


def test_prediction_width_is_the_typical_batch_prompt():
    batches = Batches(["a"] * 5, [[1] * 3, [1] * 9, [1] * 4, [1] * 5, [1] * 30], 2)
    assert (batches.rows, batches.longest, batches.width) == (2, 30, 9)  # batches padded to 9, 5 and 30


@pytest.mark.slow  # whole runs, one per policy
@pytest.mark.parametrize("hook", ["align_per_call", "functional_call", "chained", "prefetch"])
def test_batched_outputs_equal_memory_in_the_same_batches(tmp_path, hook):
    # 5 prompts of different lengths in batches of 2: batch shapes change (width, and 2 -> 1 rows at the end)
    prompts = _prompts(
        tmp_path, ["a", "the longest prompt of them all", "mid length", json.dumps({"prompt": "json"}), "z"]
    )
    cfg = _cfg(
        [
            "model=synthetic",
            "model.preset=small",
            f"hook={hook}",
            "storage=memmap",
            f"prompts={prompts}",
            "batch_size=2",
            "max_memory.cpu=20MiB",
            "progress=false",
            "max_new_tokens=3",
            "compare_in_memory=true",
            f"offload_folder={tmp_path / 'off'}",
        ]
    )
    result = run(cfg, output_dir=tmp_path / "out")
    assert result.matches_in_memory is True
    lines = [json.loads(line) for line in (tmp_path / "out" / "generations.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in lines] == ["a", "the longest prompt of them all", "mid length", "json", "z"]
    assert all(r["matches_in_memory"] and len(r["token_ids"]) == 3 for r in lines)
    f = result.figures
    assert (
        f["generated_tokens"] == 15
        and f["aggregate_tokens_per_s"] > 0
        and f["latency_p90_s"] >= f["latency_median_s"] > 0
    )
    assert f["offloaded_bytes"] > 0 and f["bytes_moved_per_token"] > 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["batch_size"] == 2 and metrics["planned_kv_cache_bytes"] > 0
    if hook == "prefetch":
        assert f["prefetch"]["hits"] > f["prefetch"]["misses"]  # the recorded order survived the changes of shape


@pytest.mark.slow  # two whole runs
def test_bytes_moved_per_generated_token_falls_with_the_batch(tmp_path):
    prompts = _prompts(tmp_path, [f"prompt {i}" for i in range(4)])
    moved = {}
    for batch in (1, 4):
        cfg = _cfg(
            [
                "model=synthetic",
                "model.preset=small",
                "hook=align_per_call",
                "storage=memmap",
                f"prompts={prompts}",
                f"batch_size={batch}",
                "max_memory.cpu=40MiB",
                "progress=false",
                "max_new_tokens=3",
                f"offload_folder={tmp_path / f'off{batch}'}",
            ]
        )
        moved[batch] = run(cfg, output_dir=tmp_path / f"b{batch}").figures["bytes_moved_per_token"]
    assert moved[4] == pytest.approx(moved[1] / 4, rel=0.01)


def test_sweep_summary_shows_predicted_beside_measured(tmp_path):
    from offload_core.runner.sweep import COLUMNS, summarize

    job = tmp_path / "0"
    job.mkdir()
    (job / "metrics.json").write_text(
        json.dumps(
            {
                "choices": {"placement": "sequential", "storage": "memmap", "hook": "prefetch", "model": "synthetic"},
                "overrides": ["batch_size=8"],
                "batch_size": 8,
                "load_s": 1.0,
                "predicted_load_s": 1.25,
                "time_per_decode_step_s": 0.5,
                "predicted_step_s": 0.4,
                "aggregate_tokens_per_s": 16.0,
                "latency_median_s": 2.0,
                "latency_p90_s": 3.0,
            }
        )
    )
    (row,) = summarize(tmp_path)
    assert (row["batch_size"], row["predicted_load_s"], row["predicted_step_s"], row["aggregate_tokens_per_s"]) == (
        8,
        1.25,
        0.4,
        16.0,
    )
    assert row["predicted_ttft_s"] == "" and row["status"] == "ok"
    assert COLUMNS.index("predicted_step_s") == COLUMNS.index("time_per_decode_step_s") + 1


@pytest.mark.slow  # measures the disk twice
def test_calibration_is_measured_once_and_again_on_request(tmp_path, monkeypatch):
    from offload_core.plan.calibrate import calibrate, calibration_file
    from offload_core.plan.model import open_model

    run_model = open_model({"name": "synthetic", "preset": "tiny"}, None)
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OFFLOAD_CORE_CALIBRATION")  # beside that cache, as a user's is
    folders = {"offload_folder": tmp_path / "not-yet" / "off", "checkpoint": tmp_path}
    args = (
        run_model.model,
        run_model.no_split,
        run_model.dtype,
        torch.device("cpu"),
        folders,
        {"prefill": (2, 5), "decode": (2, 1)},
    )
    first = calibrate(*args)
    assert first["offload_folder"]["cold_read_bps"] > 0
    assert all(
        first["compute"][name]["block_s"] > 0 and first["compute"][name]["head_s"] > 0 for name in ("prefill", "decode")
    )
    assert not (tmp_path / "not-yet").exists() and [p.name for p in tmp_path.iterdir()] == [
        "cache"
    ]  # probes cleaned up
    written = calibration_file().stat().st_mtime_ns
    assert calibrate(*args) == first and calibration_file().stat().st_mtime_ns == written  # cached
    again = calibrate(*args, refresh=True)
    assert calibration_file().stat().st_mtime_ns != written and again["compute"].keys() == first["compute"].keys()
    # a filesystem measured by an older rule (no first-touch rate) is measured again, not called damaged
    assert first["offload_folder"]["first_touch_bps"] > 0 and first["offload_folder"]["copy_bps"] > 0
    data = json.loads(calibration_file().read_text())
    for disk in data["disks"].values():
        del disk["first_touch_bps"]
    calibration_file().write_text(json.dumps(data))
    with contextlib.redirect_stderr(io.StringIO()) as said:
        assert calibrate(*args)["checkpoint"]["first_touch_bps"] > 0
    assert "damaged" not in said.getvalue()


def test_batch_memory_worked_by_hand():
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=3,
        intermediate_size=128,
        vocab_size=100,
    )
    one = batch_memory(config, batch=1, prompt_tokens=10, new_tokens=6, dtype=torch.bfloat16)
    # per prompt token: hidden in and out 128, q/k/v (8 + 2 x 2 heads) x 8 = 96, attention out 64, MLP 3 x 128 = 384:
    # 672 values x 10 tokens x 2 bytes; scores 8 heads x 10 x 16 x 2 bytes; float32 logits and softmax 2 x 100 x 4
    assert one.activations == 13_440 + 2_560 + 800 and one.total == 3_072 + 16_800
    from transformers import GPT2Config

    gpt2 = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50)  # no kv heads, head_dim nor intermediate_size
    two = batch_memory(gpt2, batch=2, prompt_tokens=3, new_tokens=1, dtype=torch.float32)
    assert two.kv_cache == 2 * 2 * 4 * 8 * 2 * 4 * 4 == 4_096  # kv heads = heads, head_dim = 32 / 4
    assert two.activations == 13_824 + 384 + 800  # 576 values a prompt token (MLP 4 x 32 wide)
    assert largest_batch(config, one.total * 3, 10, 6, torch.bfloat16, upto=2) == 2  # capped by upto
    assert largest_batch(config, one.total, 10, 6, torch.bfloat16, upto=3) == 1  # 2 x 19,872 does not fit
    from transformers import LlavaConfig

    composite = LlavaConfig(text_config=config.to_dict())  # a multimodal config: its text model's sizes count
    assert batch_memory(composite, batch=1, prompt_tokens=10, new_tokens=6, dtype=torch.bfloat16).total == 19_872
    assert largest_batch(config, 2 * one.total, 10, 6, torch.bfloat16, upto=7) == 2
