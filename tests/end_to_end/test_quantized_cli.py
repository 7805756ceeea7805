"""``python run.py model=local model.path=<a quantized checkpoint>`` as users run it: a torchao int8 and a
bitsandbytes nf4 checkpoint offloaded to disk, packed, give the in-memory quantized model's tokens and exit 0; a
quantization method offload_core does not run ends in one line naming it, with nothing written into the folder (that
command line runs in this process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from offload_core.loading.checkpoint import Checkpoint
from tests import ROOT, preloaded
from tests.end_to_end.helpers import assert_one_line, child_env, cli, snapshot
from tests.quantized_checkpoints import float_folder, quantized_folder

pytestmark = pytest.mark.slow


def _run(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    command = [sys.executable, "run.py", "progress=false", f"hydra.run.dir={tmp_path / 'run'}", *args]
    return preloaded.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("method", ["torchao-int8", "bnb-nf4"])
def test_a_quantized_checkpoint_runs_offloaded_packed_from_the_command_line(method, tmp_path):
    folder = quantized_folder(tmp_path, method)
    with Checkpoint.open(folder) as checkpoint:
        budget = checkpoint.total_bytes() // 2 + 30_000  # half the packed model, and room for a short generation
    done = _run(
        [
            "model=local",
            f"model.path={folder}",
            "model.tokenizer=bytes",
            f"max_memory.cpu={budget}",
            "headroom=1KiB",
            "max_new_tokens=4",
            "compare_in_memory=true",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["matches_in_memory"] is True
    assert metrics["devices"]["disk"]["bytes"] > 0
    assert "same tokens as in memory: True" in done.stdout


def test_an_unsupported_quantization_method_is_one_line_and_writes_nothing(tmp_path, capsys):
    folder = tmp_path / "awq"
    folder.mkdir()
    for file in float_folder(tmp_path).iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    before = snapshot(folder)
    code, err = cli(["model=local", f"model.path={folder}", "model.tokenizer=bytes"], tmp_path, capsys)
    assert code != 0
    assert_one_line(err, "quantized with 'awq'", "torchao or bitsandbytes")
    assert snapshot(folder) == before
