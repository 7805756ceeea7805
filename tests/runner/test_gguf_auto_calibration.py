"""``auto=true`` for a GGUF checkpoint, ranked from the calibration file itself: both ways of holding the file are
candidates and shown, the file's rates decide between the GGUF file and the converted floats, a damaged file is
measured again, and a GGUF file and the floats converted from it share one compute timing and one probe."""

from __future__ import annotations

import json

import pytest
import torch

from offload_core.plan.dequant import SECTION
from offload_core.storage.gguf.rates import CONVERT


@pytest.fixture
def calibration(tmp_path, monkeypatch):
    """The calibration file of this test alone (the runs read and write it)."""
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("OFFLOAD_CORE_CALIBRATION", str(path))
    monkeypatch.setenv("OFFLOAD_CORE_CORRECTIONS", str(tmp_path / "corrections.json"))
    return path


@pytest.fixture
def gguf_model(tmp_path):
    from tests.gguf_files import write_gguf

    (tmp_path / "model").mkdir()
    return write_gguf(tmp_path / "model" / "tiny.gguf", "qwen2", default=2)  # Q4_0


def _auto(compose_run, out, model_path, extra=()):
    """``auto=true plan_only=true`` with the page cache dropped (every offloaded byte from the disk): the table."""
    from offload_core.runner.job import run

    overrides = [
        "model=local",
        f"model.path={model_path}",
        "progress=false",
        "max_new_tokens=4",
        "max_memory.cpu=3MiB",
        "over_budget=warn",  # a tiny budget: the units in flight alone are over it
        "headroom=0",
        "hook=align_per_call",
        "page_cache=0",
        "plan_only=true",
        "auto=true",
        *extra,
    ]
    run(compose_run(overrides), output_dir=out, labels={"overrides": overrides}, plot=False)
    return json.loads((out / "auto.json").read_text())


def _rewrite(path, disk_bps: float, dequant_bps: float) -> None:
    """The calibration file with every disk's cold reads at ``disk_bps`` and every dequantization at ``dequant_bps``
    (the rest as measured)."""
    data = json.loads(path.read_text())
    for disk in data["disks"].values():
        disk["cold_read_bps"] = disk_bps
    for rates in data[SECTION].values():
        for name in rates:
            rates[name] = dequant_bps if name == CONVERT else {"fresh_bps": dequant_bps, "into_bps": dequant_bps}
    path.write_text(json.dumps(data))


def _first_store(table) -> str:
    return table[0]["configuration"].split()[0]


@pytest.mark.slow
def test_auto_ranks_the_gguf_choices_by_the_calibration_file(compose_run, tmp_path, calibration, gguf_model, capsys):
    first = _auto(compose_run, tmp_path / "measured", gguf_model)
    variants = {row["configuration"].split()[1] for row in first if row["configuration"].startswith("storage=gguf ")}
    assert variants == {"storage.resident=dequantized", "storage.resident=quantized"}
    out = capsys.readouterr().out
    # each choice shown with what its plan keeps quantized and dequantizes
    assert "storage.resident=quantized hook=align_per_call" in out
    for how in ("held quantized in memory", "read quantized in place"):
        shown = [line for line in out.splitlines() if line.startswith(f"    gguf, offloaded: {how}, dequantized")]
        assert len(shown) == 1 and "Q4_0 x" in shown[0]
    assert "    dequantizing: in all:" in out
    data = json.loads(calibration.read_text())
    assert any("Q4_0" in rates for rates in data[SECTION].values())  # measured and kept
    assert len(data["compute"]) == 1  # the GGUF model and its converted floats: one timing

    _rewrite(calibration, disk_bps=2e4, dequant_bps=1e13)  # a slow disk, dequantizing free
    assert _first_store(_auto(compose_run, tmp_path / "slow-disk", gguf_model)) == "storage=gguf"
    _rewrite(calibration, disk_bps=1e13, dequant_bps=1e3)  # the disk free, dequantizing slow
    assert _first_store(_auto(compose_run, tmp_path / "slow-dequant", gguf_model)) != "storage=gguf"


#: damages a calibration file may come with (a crash of another program, a hand edit)
DAMAGES = {
    "not JSON": lambda data: "{ not json",
    "a section not an object": lambda data: {**data, SECTION: ["not", "rates"]},
    "a negative rate": lambda data: {**data, SECTION: {k: {"Q4_0": {"into_bps": -1.0}} for k in data[SECTION]}},
    "not numbers": lambda data: {**data, SECTION: {k: {"Q4_0": "fast", CONVERT: True} for k in data[SECTION]}},
}


@pytest.mark.slow
def test_a_damaged_calibration_is_measured_again_never_trusted(compose_run, tmp_path, calibration, gguf_model):
    _auto(compose_run, tmp_path / "first", gguf_model)
    for name, damage in DAMAGES.items():
        damaged = damage(json.loads(calibration.read_text()))
        calibration.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
        table = _auto(compose_run, tmp_path / name.replace(" ", "-"), gguf_model)
        assert all(row["predicted_step_s"] > 0 for row in table if not row["problem"]), name
        rates = json.loads(calibration.read_text())[SECTION]
        for held in rates.values():  # rewritten whole: every rate a positive number again
            assert set(held["Q4_0"]) == {"fresh_bps", "into_bps"}, name
            assert all(isinstance(v, float) and v > 0 for v in held["Q4_0"].values()), name
            assert isinstance(held[CONVERT], float) and held[CONVERT] > 0, name


def test_a_gguf_store_is_probed_as_the_converted_files_are():
    from offload_core.plan.predict import probed_storage

    assert probed_storage({"name": "gguf", "resident": "quantized", "compute": "exact"}) == {"name": "safetensors"}
    assert probed_storage({"name": "gguf", "resident": "dequantized", "compute": "exact"}) == {"name": "safetensors"}
    assert probed_storage({"name": "memmap", "verify": True}) == {"name": "memmap", "verify": True}


def test_a_gguf_file_and_the_floats_converted_from_it_share_one_compute_timing(tmp_path, calibration, gguf_model):
    from offload_core.plan.calibrate import calibrate
    from offload_core.plan.model import open_model

    section = {"name": "local", "path": str(gguf_model)}
    folders = {"checkpoint": tmp_path}
    shapes = {"decode": (1, 1)}
    for reads_gguf in (True, False):  # the file read in place, then the float32 files converted from it
        run_model = open_model(section, None, reads_gguf)
        found = calibrate(run_model.model, run_model.no_split, run_model.dtype, torch.device("cpu"), folders, shapes)
        assert found["compute"]["decode"]["block_s"] > 0
    assert len(json.loads(calibration.read_text())["compute"]) == 1


@pytest.mark.slow
def test_a_gguf_plan_reads_the_files_quantized_blocks_from_the_disk(compose_run, tmp_path, gguf_model, capsys):
    from offload_core.runner.job import run

    overrides = [
        "model=local",
        f"model.path={gguf_model}",
        "progress=false",
        "max_memory.cpu=2MiB",
        "headroom=0",
        "storage=gguf",
        "page_cache=0",
        "plan_only=true",
    ]
    run(compose_run(overrides), output_dir=tmp_path / "out", labels={"overrides": overrides}, plot=False)
    lines = capsys.readouterr().out.splitlines()
    (moved,) = [line.split(": ")[1] for line in lines if line.startswith("predicted bytes moved per generated token")]
    (cache,) = [line for line in lines if line.startswith("page cache:")]
    # every offloaded tensor streamed from the disk each token: the file's quantized blocks, not the float32 tensors;
    # the kept set is planned in the same bytes (the page cache holds the file's pages)
    assert cache.endswith(f"predicted disk reads per generated token: {moved}")
    assert f"kept set 0 B of {moved} offloaded" in cache and f"streamed {moved};" in cache
