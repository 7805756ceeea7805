"""Runs as users run them: ``python run.py`` as a process of its own, on a transformers-saved Mixtral for every
policy x store (one sweep of them all; the tokens of the in-memory model), and on SmolLM2 for every policy
and every store (the answer printed), must exit by itself, within a bound of writing its metrics; the same for
``python -m offload_core run`` (one of SmolLM2's runs) and a two-job sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import ROOT

HOOKS = ["align_per_call", "chained", "functional_call", "prefetch", "experts"]
STORES = ["memmap", "safetensors", "pinned_cpu"]
#: a run's whole life (a process starting torch on a busy two-core machine) and the time it has to exit once it wrote
#: its metrics, on a machine no busier than one runnable process per core
RUN_S, EXIT_S = 180, 8


def exit_bound() -> float:
    """:data:`EXIT_S` times the load per core when that is over 1: a SmolLM2 run's interpreter spends about 1.5 s of
    CPU collecting its objects as it exits, which took 7 s at load average 14 on 2 cores. A hung exit (a thread
    left waiting) still fails: it never ends."""
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        per_core = 1.0
    return EXIT_S * max(1.0, per_core)


#: SmolLM2's runs: each store once (memmap's folder is sealed on a thread before the run exits), prefetch and experts
#: (reader threads of their own) among the policies. Every policy x store runs as a process on the tiny Mixtral below,
#: and on SmolLM2 in this process (tests/end_to_end/test_fidelity_smollm2.py): the real model's runs add its size, its
#: tokenizer and its answer. Each by one of the commands users start it with.
SMOLLM2_RUNS = [
    ("functional_call", "pinned_cpu", "run.py"),
    ("prefetch", "memmap", "run.py"),
    ("experts", "safetensors", "python -m offload_core run"),
]


def run_as_user(args: list[str], cwd: Path, done: Path) -> tuple[int, str, str]:
    """Start ``args``; it must finish within :data:`RUN_S` and exit within :func:`exit_bound` of writing ``done``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started, written = time.monotonic(), None
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=0.5)
                return proc.returncode, out, err
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if written is None and done.exists():
                written = now
            bound = exit_bound()
            if now - started > RUN_S or (written is not None and now - written > bound):
                proc.kill()
                out, err = proc.communicate(timeout=60)
                what = f"did not exit within {bound:.0f} s of writing {done.name}" if written else f"ran past {RUN_S} s"
                pytest.fail(f"{' '.join(args[1:])} {what}\n{out[-1500:]}\n{err[-1500:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    """A tiny MixtralForCausalLM saved with ``save_pretrained`` (per-expert tensors, as the Hub's checkpoints)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=256,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mixtral") / "ckpt"
    MixtralForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "hook, store, command", [pytest.param(*run, id=f"smollm2-{run[0]}-{run[1]}") for run in SMOLLM2_RUNS]
)
def test_smollm2_run_exits_with_the_answer(hook, store, command, tmp_path):
    module = command.startswith("python -m")  # started in the repository's folder
    args = [
        sys.executable,
        *(["-m", "offload_core", "run"] if module else [str(ROOT / "run.py")]),
        f"hook={hook}",
        f"storage={store}",
        "max_new_tokens=8",
        "max_memory.cpu=150MiB",
        f"hydra.run.dir={tmp_path}",
        *(["over_budget=warn"] if store == "pinned_cpu" else []),  # it holds the disk tier in memory too
    ]
    code, out, err = run_as_user(args, ROOT if module else tmp_path, tmp_path / "metrics.json")
    assert code == 0, err[-2000:]
    assert "Paris" in out and json.loads((tmp_path / "metrics.json").read_text())["devices"]["disk"]["bytes"] > 0


def test_moe_run_exits_with_the_in_memory_tokens(mixtral, tmp_path):
    """Every policy on every store: one process sweeping them, which exits by itself once its last job is done (a
    thread or a store any job left behind would hold it), each job with the in-memory model's tokens."""
    jobs = [(hook, store) for store in STORES for hook in HOOKS]  # Hydra's order: the last key varies fastest
    args = [
        sys.executable,
        str(ROOT / "run.py"),
        "-m",
        "model=local",
        "model.tokenizer=bytes",
        f"model.path={mixtral}",
        f"storage={','.join(STORES)}",
        f"hook={','.join(HOOKS)}",
        "max_new_tokens=4",
        "max_memory.cpu=500KiB",
        "over_budget=warn",  # the tiny model's units in flight are larger than 500 KiB
        "compare_in_memory=true",
        f"hydra.sweep.dir={tmp_path}",
    ]
    code, out, err = run_as_user(args, tmp_path, tmp_path / "summary.csv")
    assert code == 0, err[-2000:]
    assert out.count("same tokens as in memory: True") == len(jobs), out[-2000:]
    ran = set()
    for job in range(len(jobs)):
        metrics = json.loads((tmp_path / str(job) / "metrics.json").read_text())
        assert len(metrics["token_ids"]) == 4 and metrics["devices"]["disk"]["bytes"] > 0, job
        ran.add((metrics["choices"]["hook"], metrics["choices"]["storage"]))
    assert ran == set(jobs)
    rows = (tmp_path / "summary.csv").read_text().splitlines()[1:]
    assert len(rows) == len(jobs) and all(",ok,True," in row for row in rows), rows


def test_a_two_job_sweep_exits_with_its_summary(tmp_path):
    args = [
        sys.executable,
        str(ROOT / "run.py"),
        "-m",
        "model=synthetic",
        "hook=align_per_call,chained",
        "storage=safetensors",
        "max_new_tokens=2",
        "compare_in_memory=true",
        f"hydra.sweep.dir={tmp_path}",
    ]
    code, out, err = run_as_user(args, tmp_path, tmp_path / "summary.csv")
    assert code == 0, err[-2000:]
    rows = (tmp_path / "summary.csv").read_text().splitlines()[1:]
    assert len(rows) == 2 and all(",ok,True," in row for row in rows), rows


#: prompts of the interrupted run (batches of 2, 24 tokens each): enough batches that the signal comes before the last
#: on a fast machine
PROMPTS = 16


def test_an_interrupted_batch_run_keeps_its_prompts_and_resumes(tmp_path):
    """Ctrl-C (SIGTERM unwinds the same way: cli.Terminated is a KeyboardInterrupt) after the first batch (of 16)."""
    sig, code = signal.SIGINT, 130
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}: tell me about number {i}\n" for i in range(PROMPTS)))
    args = [
        sys.executable,
        str(ROOT / "run.py"),
        "model=synthetic",
        "storage=safetensors",
        f"prompts={prompts}",
        "batch_size=2",
        "max_new_tokens=24",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    first, journal = tmp_path / "first", tmp_path / "first" / "generations.jsonl"
    proc = subprocess.Popen(
        [*args, f"hydra.run.dir={first}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal delivers it: a suite started in the background (``cmd &``) ignores SIGINT, which its
        # children would inherit
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        started = time.monotonic()
        while not (journal.exists() and journal.read_bytes().count(b"\n") >= 2):
            assert proc.poll() is None and time.monotonic() - started < RUN_S, "no batch finished"
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    kept = journal.read_text().splitlines()
    assert proc.returncode == code and 2 <= len(kept) < PROMPTS and len(kept) % 2 == 0, err
    assert f"{len(kept)} finished prompts are in {journal}; go on with resume={first}" in err
    resumed = subprocess.run(
        [*args, f"resume={first}", f"hydra.run.dir={tmp_path / 'second'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming {first}: {len(kept)} of {PROMPTS} prompts were generated" in resumed.stdout
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [r["prompt"] for r in records] == prompts.read_text().splitlines()
    assert [json.dumps(r) for r in records[: len(kept)]] == kept  # the finished prompts kept as they were
