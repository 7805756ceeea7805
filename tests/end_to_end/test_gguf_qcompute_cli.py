"""``storage.compute=quantized`` as users run it: ``python run.py model=local model.path=<file.gguf> storage=gguf
storage.compute=quantized`` answers and exits 0, its plan naming what computes quantized; with another store, or a
mode it does not know, one line (those command lines run in this process)."""

from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType as T

from tests.end_to_end.helpers import assert_one_line, cli
from tests.end_to_end.test_gguf_cli import _run
from tests.gguf_files import write_gguf

pytestmark = pytest.mark.slow


@pytest.fixture
def gguf_file(tmp_path):
    types = {"ffn_down": int(T.Q4_K), "ffn_up": int(T.Q8_0), "attn_v": int(T.Q6_K)}
    (tmp_path / "model").mkdir()
    return write_gguf(tmp_path / "model" / "tiny.gguf", "qwen2", types, default=int(T.Q4_0))


def test_quantized_compute_runs_from_the_command_line(gguf_file, tmp_path):
    args = ["model=local", f"model.path={gguf_file}", "storage=gguf", "storage.compute=quantized"]
    done = _run([*args, "max_memory.cpu=1MiB", "headroom=0", "max_new_tokens=4", "prompt=the th"], tmp_path, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "computed quantized (storage.compute=quantized): Q4_0 x" in done.stdout
    assert "Q4_K x3 as int4" in done.stdout and "Q8_0 x3 as int8" in done.stdout
    assert "left exact, Q6_K: no packed kernel takes its type" in done.stdout
    metrics = json.loads((tmp_path / "hydra" / "metrics.json").read_text())
    assert len(metrics["token_ids"]) == 4 and metrics["bytes_moved_per_token"] > 0


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["storage.compute=quantized"], "unknown key 'compute' in storage.compute"),
        (["storage=gguf", "storage.compute=fast"], "storage.compute='fast' is not one of exact, quantized"),
    ],
)
def test_what_cannot_apply_is_one_line(gguf_file, tmp_path, extra, needle, capsys):
    code, err = cli(["model=local", f"model.path={gguf_file}", *extra], tmp_path / "run", capsys)
    assert code != 0
    assert_one_line(err, needle)
