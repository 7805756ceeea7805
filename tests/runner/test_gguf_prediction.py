"""The time prediction of ``storage=gguf``: the dequantization rate per GGML type measured once and cached (a damaged
entry measured again), the seconds per token the plan's offloaded tensors take to dequantize, and how they weigh
against reading the converted float32 files in ``auto=true``'s ranking, warm and cold."""

from __future__ import annotations

import json

import pytest
import torch

from offload_core.plan import dequant
from offload_core.plan.dequant import dequant_lines, dequant_rates, dequant_seconds, rates_key
from offload_core.plan.predict import predict_time
from offload_core.storage.gguf.rates import CONVERT

RATES = {"Q4_1": {"fresh_bps": 1e9, "into_bps": 2e9}, "F32": {"fresh_bps": 4e9, "into_bps": 8e9}, CONVERT: 5e9}


def _rows():
    return [
        {"type": "F32", "converted": False, "tensors": 4, "read_bytes": 4 * 10**6, "dequant_bytes": 4 * 10**6},
        {"type": "Q4_1", "converted": False, "tensors": 10, "read_bytes": 75 * 10**6, "dequant_bytes": 4 * 10**8},
        {"type": "Q4_1", "converted": True, "tensors": 2, "read_bytes": 15 * 10**6, "dequant_bytes": 8 * 10**7},
    ]


def test_each_type_is_priced_at_its_rate_and_a_converted_tensor_pays_the_processor_pass():
    rows = _rows()
    fresh = dequant_seconds(rows, RATES, held_buffers=False)
    # a converted tensor is dequantized into a buffer held for it, then un-permuted
    assert [row["predicted_s"] for row in rows] == pytest.approx([1e-3, 0.4, 0.04 + 0.016])
    assert fresh == pytest.approx(1e-3 + 0.4 + 0.056)
    held = dequant_seconds(rows, RATES, held_buffers=True)  # hook=prefetch's buffers: no new tensor per read
    assert held == pytest.approx(0.5e-3 + 0.2 + 0.056)
    lines = dequant_lines(rows)
    assert lines[0].startswith("dequantized per generated token, by GGML type")
    assert "  Q4_1 x10: 71.53 MiB -> 381.47 MiB, 200.0 ms" in lines
    assert any("with transformers' processor pass" in line for line in lines)
    assert lines[-1].endswith("256.5 ms")


@pytest.fixture
def calibration_file(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("OFFLOAD_CORE_CALIBRATION", str(path))
    measured = []

    def measure(name):
        measured.append(name)
        return 3e9 if name == CONVERT else {"fresh_bps": 1e9, "into_bps": 2e9}

    monkeypatch.setattr(dequant, "measure", measure)
    return path, measured


def test_the_rates_are_measured_once_cached_and_a_damaged_entry_is_measured_again(calibration_file):
    path, measured = calibration_file
    path.write_text(json.dumps({"disks": {}}))  # the rest of the calibration kept
    rates = dequant_rates({"Q4_1", "Q8_0"})
    assert sorted(measured) == sorted(["Q4_1", "Q8_0", CONVERT])
    assert rates["Q4_1"] == {"fresh_bps": 1e9, "into_bps": 2e9} and rates[CONVERT] == 3e9
    data = json.loads(path.read_text())
    assert data["disks"] == {} and data["dequant"][rates_key()]["Q8_0"]["into_bps"] == 2e9
    measured.clear()
    assert dequant_rates({"Q4_1"}) == rates and measured == []  # cached: nothing measured
    for damaged in ({"fresh_bps": 1e9}, {"fresh_bps": -1, "into_bps": 2e9}, "fast", {"fresh_bps": True}):
        data["dequant"][rates_key()]["Q4_1"] = damaged
        path.write_text(json.dumps(data))
        assert dequant_rates({"Q4_1", "Q8_0"})["Q4_1"] == {"fresh_bps": 1e9, "into_bps": 2e9}
        assert measured == ["Q4_1"]  # that entry alone, never trusted half-written
        measured.clear()
    data["dequant"] = ["not", "an", "object"]
    path.write_text(json.dumps(data))
    dequant_rates({"Q4_1"})
    assert sorted(measured) == ["Q4_1", CONVERT]
    measured.clear()
    dequant_rates({"Q4_1"}, refresh=True)  # calibrate=true
    assert sorted(measured) == ["Q4_1", CONVERT]


def test_a_rate_measured_here_is_a_positive_rate_per_type():
    from offload_core.storage.gguf.rates import convert_rate, type_rates

    rates = type_rates(3, elements=2**14)  # Q4_1, small: the measurement's shape, not a speed
    assert set(rates) == {"fresh_bps", "into_bps"} and all(0 < v < float("inf") for v in rates.values())
    assert 0 < convert_rate(2**14) < float("inf")


class _Plan:
    def __init__(self, offloaded, moved, page_cache):
        self.summary = {"devices": {"cpu": {"bytes": 10**8, "tensors": 4}, "disk": {"bytes": offloaded, "tensors": 9}}}
        self.page_cache = page_cache
        self.predicted_bytes_per_token = moved
        self.predicted_loads_per_token = 0


class _Storage:
    reads_from, pinned = "checkpoint", False

    def __init__(self, reads_gguf):
        self.reads_gguf = reads_gguf


class _Policy:
    def __init__(self, overlaps_io=False):
        self.overlaps_io = overlaps_io


CALIBRATION = {
    "checkpoint": {"write_bps": 1e9, "cold_read_bps": 1e9, "warm_read_bps": 8e9, "first_touch_bps": 8e9},
    "offload_folder": {"write_bps": 1e9, "cold_read_bps": 1e9, "warm_read_bps": 8e9},
    "compute": {"prefill": {"block_s": 0.02}, "decode": {"block_s": 0.01}},
}
FLOAT32 = 4 * 10**8  # the offloaded weights as float32
QUANTIZED = 75 * 10**6  # as Q4_1 blocks


def _step(gguf, page_cache, cold=False, device="cpu", overlaps=False, cold_read_bps=1e9) -> dict:
    rows = _rows()[1:2]
    dequant_s = dequant_seconds(rows, RATES, held_buffers=False) if gguf else 0.0
    plan = _Plan(FLOAT32, QUANTIZED if gguf else FLOAT32, page_cache)
    disk = {**CALIBRATION["checkpoint"], "cold_read_bps": cold_read_bps}
    calibration = {**CALIBRATION, "checkpoint": disk, "h2d_bps": 1e10}
    return predict_time(10, plan, _Storage(gguf), _Policy(overlaps), torch.device(device), calibration, cold, dequant_s)


def test_warm_the_float32_pages_are_computed_on_in_place_and_win():
    kept = {"predicted_disk_bytes_per_token": 0}
    converted, gguf = _step(False, kept), _step(True, kept)
    assert converted["predicted_step_s"] == pytest.approx(0.1)  # nothing read from the disk, nothing dequantized
    assert gguf["predicted_dequant_s"] == pytest.approx(0.4)
    assert gguf["predicted_step_s"] == pytest.approx(0.1 + 0.4)
    assert converted["predicted_step_s"] < gguf["predicted_step_s"]


def test_cold_the_quantized_bytes_win():
    streamed = {"predicted_disk_bytes_per_token": FLOAT32}  # page_cache=0: every offloaded byte from the disk
    in_file = {"predicted_disk_bytes_per_token": QUANTIZED}  # the GGUF plan's: the file's quantized blocks read
    converted, gguf = _step(False, streamed), _step(True, in_file)
    assert converted["predicted_io_s"] == pytest.approx(0.4)  # 400 MB at 1 GB/s
    assert gguf["predicted_io_s"] == pytest.approx(0.075)  # the file's quantized blocks streamed instead
    converted, gguf = _step(False, streamed, cold_read_bps=2e8), _step(True, in_file, cold_read_bps=2e8)
    assert converted["predicted_step_s"] == pytest.approx(0.1 + 2.0)
    assert gguf["predicted_step_s"] == pytest.approx(0.1 + 0.375 + 0.4)
    assert gguf["predicted_step_s"] < converted["predicted_step_s"]
    dropped = _step(True, {}, cold=True)  # page cache dropped before each token: the moved bytes from the disk
    assert dropped["predicted_io_s"] == pytest.approx(0.075)


def test_on_a_gpu_an_overlapping_policy_dequantizes_while_the_device_computes():
    kept = {"predicted_disk_bytes_per_token": 0}
    serial = _step(True, kept, device="cuda")
    overlapped = _step(True, kept, device="cuda", overlaps=True)
    io = QUANTIZED / 1e10 + QUANTIZED / 8e9
    assert serial["predicted_step_s"] == pytest.approx(0.1 + 0.4 + io)
    assert overlapped["predicted_step_s"] == pytest.approx(max(0.1, io + 0.4))


@pytest.fixture
def given_rates(monkeypatch):
    """The calibration a run reads, given: a disk of ``cold_read_bps`` (set per test), blocks that compute in 1 ms,
    Q4_0 dequantized at 1 GB/s."""
    from offload_core.plan import calibrate

    disk = {"write_bps": 1e9, "cold_read_bps": 1e9, "warm_read_bps": 8e9, "first_touch_bps": 8e9, "copy_bps": 1e9}
    given = {"disk": disk}

    def calibrated(*args, **kwargs):
        block = {"block_s": 1e-3}
        return {
            "checkpoint": given["disk"],
            "offload_folder": given["disk"],
            "compute": {"prefill": block, "decode": block},
        }

    monkeypatch.setattr(calibrate, "calibrate", calibrated)
    rates = {kind: {"fresh_bps": 1e9, "into_bps": 1e9} for kind in ("Q4_0", "F32", "Q8_0", "Q6_K", "Q4_K")}
    monkeypatch.setattr(dequant, "dequant_rates", lambda types, refresh=False: {**rates, CONVERT: 1e9})
    return given


def _auto(compose_run, tmp_path, model_path, extra):
    from offload_core.runner.job import run

    overrides = [
        "model=local",
        f"model.path={model_path}",
        "progress=false",
        "max_new_tokens=4",
        "max_memory.cpu=1MiB",
        "over_budget=warn",  # a tiny budget: the units in flight alone are over it
        "headroom=0",
        "hook=align_per_call",
        "plan_only=true",
        "auto=true",
        *extra,
    ]
    run(compose_run(overrides), output_dir=tmp_path, labels={"overrides": overrides}, plot=False)
    return json.loads((tmp_path / "auto.json").read_text())


def test_auto_reads_a_gguf_in_place_cold_and_the_converted_floats_warm(compose_run, tmp_path, given_rates, capsys):
    from tests.gguf_files import write_gguf

    (tmp_path / "model").mkdir()
    path = write_gguf(tmp_path / "model" / "tiny.gguf", "qwen2", default=2)  # Q4_0
    warm = _auto(compose_run, tmp_path / "warm", path, [])
    stores = [row["configuration"].split()[0] for row in warm if not row["problem"]]
    assert "storage=gguf" in stores and stores[0] != "storage=gguf"  # page-cached float32: nothing dequantized
    out = capsys.readouterr().out
    assert "auto: the converted float32 files predicted" in out and "s dequantizing" in out
    given_rates["disk"] = {**given_rates["disk"], "cold_read_bps": 2e6}  # a slow disk, nothing kept in the cache
    cold = _auto(compose_run, tmp_path / "cold", path, ["page_cache=0"])
    assert cold[0]["configuration"].startswith("storage=gguf ")  # an eighth of the bytes from the disk
    variants = {row["configuration"].split()[1] for row in cold if row["configuration"].startswith("storage=gguf ")}
    assert variants == {"storage.resident=dequantized", "storage.resident=quantized"}  # each choice in the table
    assert "auto: reading the GGUF file in place predicted" in capsys.readouterr().out


def test_auto_leaves_the_gguf_store_out_for_a_model_without_a_gguf_file(compose_run, tmp_path, given_rates, saved):
    table = _auto(compose_run, tmp_path, saved("llama").path, ["model.tokenizer=bytes"])
    assert [row for row in table if not row["problem"]]
    assert not any(row["configuration"].startswith("storage=gguf ") for row in table)


def test_a_type_whose_rate_cannot_be_measured_is_left_out_and_said(calibration_file, monkeypatch, capsys):
    path, measured = calibration_file

    def fails(name):
        if name == "IQ2_XXS":
            raise ValueError("no such grid")
        return 3e9 if name == CONVERT else {"fresh_bps": 1e9, "into_bps": 2e9}

    monkeypatch.setattr(dequant, "measure", fails)
    rates = dequant_rates({"Q4_1", "IQ2_XXS"})
    assert "IQ2_XXS" not in rates and "no dequantization rate for IQ2_XXS" in capsys.readouterr().out
    assert "IQ2_XXS" not in json.loads(path.read_text())["dequant"][rates_key()]  # nothing half-written kept
    rows = [{**_rows()[1], "type": "IQ2_XXS"}, _rows()[1]]
    assert dequant_seconds(rows, rates, held_buffers=False) == pytest.approx(0.4)
    assert "predicted_s" not in rows[0] and "not predicted" in dequant_lines(rows)[1]
