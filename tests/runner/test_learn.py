"""Learning from the run: the corrections file is validated (a damaged or foreign one is ignored with one line and
remade), a correction moves the next prediction of the same configuration toward what was measured, and a whole run
records predicted against measured in metrics.json and prints the comparison."""

from __future__ import annotations

import json
import os

import pytest

from offload_core.plan import learn

PREDICTED = {"predicted_load_s": 0.5, "predicted_ttft_s": 0.01, "predicted_step_s": 0.02}
MEASURED = {"load_s": 1.0, "time_to_first_token_s": 0.05, "time_per_decode_step_s": 0.08}


@pytest.fixture
def corrections(tmp_path, monkeypatch):
    path = tmp_path / "corrections.json"
    monkeypatch.setenv("OFFLOAD_CORE_CORRECTIONS", str(path))
    return path


def test_a_damaged_or_foreign_corrections_file_is_ignored_with_one_line_and_remade(corrections, capsys):
    learn.learn("k", "label", learn.corrected({}, PREDICTED), MEASURED)
    good = json.loads(corrections.read_text())
    assert learn.read() == good["entries"] and capsys.readouterr().err == ""
    bad_entries = [
        {"k": {"ratios": {"step": [float("inf")]}, "updated": 1}},
        {"k": {"ratios": {"step": []}, "updated": 1}},
        {"k": {"ratios": {"warp": [1.0]}, "updated": 1}},
        {"k": {"ratios": {"step": [-2.0]}, "updated": 1}},
        {"k": {"ratios": {"step": ["fast"]}, "updated": 1}},
        {"k": []},
    ]
    damaged = [json.dumps({**good, "entries": e}) for e in bad_entries]
    damaged += [json.dumps({**good, "version": 99}), json.dumps({**good, "machine": "another|x86_64|64"}), "[1]", "{"]
    for text in damaged:
        corrections.write_text(text)
        assert learn.read() == {}
        err = capsys.readouterr().err
        assert f"ignoring {corrections}" in err and err.count("\n") == 1
        # never trusted: the prediction stays the cost model's
        assert (
            learn.corrected(learn.read().get("k", {}), PREDICTED)["predicted_step_s"] == PREDICTED["predicted_step_s"]
        )
        capsys.readouterr()
    corrections.write_bytes(os.urandom(200))
    learn.learn("k", "label", learn.corrected({}, PREDICTED), MEASURED)  # remade whole
    capsys.readouterr()
    assert learn.problem(json.loads(corrections.read_text())) is None and set(learn.read()) == {"k"}
    assert not [p for p in corrections.parent.iterdir() if p.name.endswith(".tmp")]


def test_the_second_prediction_of_a_configuration_moves_to_what_was_measured(corrections):
    first = learn.corrected(learn.read().get("k", {}), PREDICTED)
    assert first["prediction_runs"] == 0 and first["predicted_step_s"] == PREDICTED["predicted_step_s"]
    learned = learn.learn("k", "label", first, MEASURED)
    assert learned["prediction"]["step"]["error"] == pytest.approx((0.02 - 0.08) / 0.08)
    second = learn.corrected(learn.read()["k"], PREDICTED)
    assert second["prediction_runs"] == 1 and second["model_predicted_step_s"] == PREDICTED["predicted_step_s"]
    for key, measured in zip(PREDICTED, MEASURED):
        assert abs(second[key] - MEASURED[measured]) < abs(first[key] - MEASURED[measured])
        assert second[key] == pytest.approx(MEASURED[measured])
    # another configuration learns nothing from it
    assert (
        learn.corrected(learn.read().get("other", {}), PREDICTED)["predicted_step_s"] == PREDICTED["predicted_step_s"]
    )
    # the median of the last runs: one stalled run does not move it
    for _ in range(3):
        learn.learn("k", "label", second, MEASURED)
    learn.learn("k", "label", second, {**MEASURED, "time_per_decode_step_s": 8.0})
    assert learn.corrected(learn.read()["k"], PREDICTED)["predicted_step_s"] == pytest.approx(0.08)


def test_the_comparison_is_one_line():
    line = learn.comparison_line(learn.learn("k", "label", learn.corrected({}, PREDICTED), MEASURED))
    assert line.startswith("predicted vs measured: load 0.5 s vs 1 s (-50%)") and "\n" not in line
    assert "decoding step 0.02 s vs 0.08 s (-75%)" in line and "learned for the next run" in line


@pytest.mark.slow  # two whole runs
def test_a_run_records_its_prediction_and_the_next_run_predicts_from_it(corrections, tmp_path, compose_run, capsys):
    from offload_core.runner.job import run

    cfg = compose_run(
        [
            "model=synthetic",
            "progress=false",
            "max_new_tokens=4",
            "max_memory.cpu=1MiB",
            "headroom=0",
            "storage=safetensors",
        ]
    )
    # a first run calibrates and probes this configuration, so the two runs below plan on the same machine figures
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OFFLOAD_CORE_CORRECTIONS", str(tmp_path / "warm-up.json"))
        run(cfg, output_dir=tmp_path / "0")
    first = run(cfg, output_dir=tmp_path / "1")
    out = capsys.readouterr().out
    written = json.loads((tmp_path / "1" / "metrics.json").read_text())
    assert written["prediction"]["step"]["measured"] == pytest.approx(written["time_per_decode_step_s"])
    assert (
        written["prediction_runs"] == 0 and "predicted vs measured: load" in out and "learned for the next run" in out
    )
    second = run(cfg, output_dir=tmp_path / "2")
    out = capsys.readouterr().out
    assert second.figures["prediction_runs"] == 1 and "corrected by 1 earlier run" in out
    for name in ("load", "ttft", "step"):
        before, after = first.figures["prediction"][name], second.figures["prediction"][name]
        # the second run's cost model times what the first run measured over what its cost model said (the cost
        # model reads the page cache as it is at each plan, so the two models can differ a little)
        ratio = before["measured"] / before["model_predicted"]
        assert after["predicted"] == pytest.approx(after["model_predicted"] * ratio)
        assert after["predicted"] == pytest.approx(before["measured"], rel=0.05)
        assert abs(after["predicted"] - before["measured"]) < abs(before["predicted"] - before["measured"])


def test_a_calibration_whose_probe_terms_are_damaged_is_not_trusted():
    from offload_core.plan.calibrate import calibration_problem

    assert calibration_problem({"probe": {"k": {"per_load_decode_s": 0.001}, "failed": {}}}) is None
    for bad in (
        {"probe": {"k": {"per_load_decode_s": -1}}},
        {"probe": {"k": {"per_load_decode_s": "x"}}},
        {"probe": {"k": [1]}},
        {"probe": [1]},
        {"probe": {"k": {"outside_decode_s": float("inf")}}},
    ):
        assert "'probe'" in calibration_problem(bad)


@pytest.fixture
def busy_machine(monkeypatch):
    """Other work holds every core: a load average of 5 per core, over the default bound of 2; this process has not
    said so yet, and torch computes with two threads."""
    from offload_core.plan import busy

    monkeypatch.delenv("OFFLOAD_CORE_BUSY_LOAD")
    monkeypatch.setattr(busy, "told", False)
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0 * cores, 5.0 * cores, 5.0 * cores))
    loaded = f"load average {5.0 * cores:.1f} on {cores} cores"
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield busy.busy_line(loaded, 2)
    torch.set_num_threads(threads)


def test_a_run_on_a_busy_machine_is_compared_but_not_learned_from(corrections, busy_machine, capsys):
    learned = learn.learn("k", "label", learn.corrected({}, PREDICTED), MEASURED)
    assert learned["learned"] is False and learned["prediction"]["step"]["measured"] == 0.08
    assert not corrections.exists() and learn.read() == {}
    assert capsys.readouterr().err == busy_machine + "\n"
    assert "load average" in busy_machine and "OMP_NUM_THREADS=1" in busy_machine
    line = learn.comparison_line(learned)
    assert line.endswith("(cost model only; not learned from: the machine is busy)")
    learn.learn("k", "label", learn.corrected({}, PREDICTED), MEASURED)
    assert capsys.readouterr().err == ""  # said once a process


def test_the_busy_line_gives_the_one_thread_hint_only_to_a_run_of_several_threads():
    from offload_core.plan.busy import busy_line

    assert busy_line("load average 9.4 on 2 cores", 2) == (
        "offload_core: the machine is busy (load average 9.4 on 2 cores): what this run measures is used for it, not "
        "kept; torch computes with 2 threads, each waiting for a core the other work holds: one thread is often "
        "several times faster here (OMP_NUM_THREADS=1 python run.py ...)"
    )
    assert busy_line("load average 9.4 on 2 cores", 1) == (
        "offload_core: the machine is busy (load average 9.4 on 2 cores): what this run measures is used for it, not "
        "kept"
    )


def test_the_busy_bound_is_the_load_per_core(monkeypatch):
    from offload_core.plan.busy import busy

    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (2.5 * cores, 0.0, 0.0))
    monkeypatch.setenv("OFFLOAD_CORE_BUSY_LOAD", "3")
    assert busy() is None
    monkeypatch.setenv("OFFLOAD_CORE_BUSY_LOAD", "2")
    assert busy() == f"load average {2.5 * cores:.1f} on {cores} cores"
    monkeypatch.delenv("OFFLOAD_CORE_BUSY_LOAD")  # the default: 2 per core
    assert busy() is not None
    monkeypatch.setenv("OFFLOAD_CORE_BUSY_LOAD", "inf")
    assert busy() is None


def test_a_calibration_measured_on_a_busy_machine_is_used_but_not_kept(tmp_path, monkeypatch, busy_machine, capsys):
    import torch

    from offload_core.plan import calibrate as calibrate_module
    from offload_core.plan.calibrate import calibrate, calibration_file
    from offload_core.plan.model import open_model

    run_model = open_model({"name": "synthetic", "preset": "tiny"}, None)
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OFFLOAD_CORE_CALIBRATION")  # beside that cache, as a user's is
    args = (run_model.model, run_model.no_split, run_model.dtype, torch.device("cpu"), {}, {"decode": (1, 1)})
    monkeypatch.setattr(calibrate_module, "told", False)
    found = calibrate(*args)
    assert found["compute"]["decode"]["block_s"] > 0  # this run predicts from it
    assert not calibration_file().exists()
    assert capsys.readouterr().err == f"{calibrate_module.MEASURING}\n{busy_machine}\n"
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    calibrate(*args)
    assert calibration_file().exists() and capsys.readouterr().err == ""
