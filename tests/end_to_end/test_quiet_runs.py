"""A run says only what it means to, as users run it (a process, its output in a log): no library's deprecation
warning caused by our calls, no loading bars with ``progress=false``, no logged warning for tensors a model makes
itself, and an error line on its own line in a log file after a progress bar cleared in place."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors import safe_open

from offload_core.loading import sources
from tests import ROOT, preloaded
from tests.checkpoints import minilm_folder
from tests.end_to_end.helpers import child_env, run_args

#: what none of these runs may print ("[transformers]" starts the lines transformers logs itself)
NOISE = (
    "torch_dtype",
    "FutureWarning",
    "Loading weights",
    "Loading pipeline components",
    "[WARNING]",
    "[transformers]",
    "accelerate",
)


def _run(args: list[str], tmp_path: Path) -> str:
    """``run.py args`` as a CI job runs it: with ``CI`` set, transformers passes its warnings to the root logger too,
    where the run's log shows them as ``[WARNING]`` lines (a clean-clone CI run showed one that a run elsewhere
    prints only as a ``[transformers]`` line)."""
    done = subprocess.run(
        [sys.executable, "run.py", "progress=false", f"hydra.run.dir={tmp_path / 'run'}", *args],
        capture_output=True,
        text=True,
        env={**child_env(), "CI": "true"},
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_an_old_checkpoint_compared_in_memory_prints_no_warning_nor_bar(tmp_path):
    """all-MiniLM-L6-v2 as users have it: a config written before transformers 5 that names no dtype, and a checkpoint
    that still holds ``embeddings.position_ids``, a buffer the model now makes itself."""
    folder = minilm_folder()
    config = json.loads((folder / "config.json").read_text())
    assert "dtype" not in config and "torch_dtype" not in config
    with safe_open(str(folder / "model.safetensors"), "pt") as checkpoint:
        assert "embeddings.position_ids" in checkpoint.keys()
    said = _run(
        [
            "model=local",
            f"model.path={folder}",
            "model.task=embeddings",
            "texts=[a cat,a dog]",
            "compare_in_memory=true",
            "max_memory.cpu=60MB",
            "headroom=8MiB",
        ],
        tmp_path,
    )
    assert "same embeddings as in memory (bit for bit): True" in said
    assert [word for word in (*NOISE, "position_ids") if word in said] == []


def test_a_pipeline_compared_in_memory_prints_no_warning_nor_bar(tmp_path):
    pytest.importorskip("diffusers", reason="the diffusion extra is not installed")
    from offload_core.testing import tiny_pipeline

    tiny_pipeline(tmp_path / "pipe")
    said = _run(
        [
            "model=local",
            f"model.path={tmp_path / 'pipe'}",
            "prompt=a cat",
            "pipeline.height=16",
            "pipeline.width=16",
            "pipeline.num_inference_steps=1",
            "compare_in_memory=true",
        ],
        tmp_path,
    )
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["matches_in_memory"] is True
    assert [line for line in said.splitlines() if any(word in line for word in NOISE)] == []


_FAILS_WHILE_LOADING = textwrap.dedent("""
    import sys
    from tqdm import tqdm
    from offload_core.errors import StorageError
    from offload_core.storage.folder import FolderStore
    real, count = FolderStore.write_file, [0]

    def failing(path, data):  # the third tensor the run's load writes (the calibration's probe writes before it)
        count[0] += any(bar.desc.startswith("loading") for bar in list(tqdm._instances))
        if count[0] == 3:
            raise StorageError("the offload folder went away; give another offload_folder")
        real(path, data)

    FolderStore.write_file = staticmethod(failing)
    from offload_core.runner.cli import hydra_main
    sys.argv = ["run.py", *sys.argv[1:]]
    hydra_main()
""")


def test_an_error_line_in_a_log_file_starts_its_own_line_after_a_cleared_progress_bar(tmp_path):
    """The run's stderr a file, as a log is (forked from the preloaded interpreter: what it prints after its imports
    is the same as a fresh process's)."""
    tiny = sources.synthetic_checkpoint(**sources.synthetic_preset("tiny"))
    script = tmp_path / "fails_while_loading.py"
    script.write_text(_FAILS_WHILE_LOADING)
    done = preloaded.run(
        [sys.executable, str(script), *run_args(tiny), "progress=true", f"hydra.run.dir={tmp_path}"],
        capture_output=True,  # into files: stderr is a file, as a log's is
        env=child_env(),
        cwd=ROOT,
        timeout=300,
    )
    text = done.stderr.decode()  # as written: text mode would make each carriage return a newline
    assert done.returncode == 2, text
    assert "loading:" in text  # the bar was drawn, then cleared in place
    errors = [line for line in text.split("\n") if "offload_core: error:" in line]
    assert errors == ["offload_core: error: the offload folder went away; give another offload_folder"], text
