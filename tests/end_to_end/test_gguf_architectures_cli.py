"""GGUF files of more architectures as users run them: ``python run.py model=local model.path=<file.gguf>`` answers
with transformers' in-memory GGUF model's tokens for a mamba file read in place (``storage=gguf``) and a gpt2 file
converted once by the default store; gpt2 with ``storage=gguf`` is one line saying to leave storage at its default."""

from __future__ import annotations

import sys

from gguf import GGMLQuantizationType as T

from tests import ROOT, preloaded
from tests.end_to_end.helpers import child_env
from tests.gguf_files import write_gguf


def _run(args, tmp_path, name):
    env = {**child_env(), "OFFLOAD_CORE_CACHE": str(tmp_path / "cache")}
    command = [
        sys.executable,
        "run.py",
        "model=local",
        "progress=false",
        "compare_in_memory=true",
        "max_new_tokens=4",
        "prompt=the th",
        "max_memory.cpu=1MiB",
        "over_budget=warn",
        "headroom=0",
        f"hydra.run.dir={tmp_path / name}",
        *args,
    ]
    return preloaded.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_mamba_read_in_place_and_gpt2_converted_run_with_the_in_memory_tokens(tmp_path):
    mamba = write_gguf(tmp_path / "mamba.gguf", "mamba", {"ssm_out": int(T.Q4_K)}, default=int(T.Q5_0), layers=2)
    gpt2 = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"ffn_down": int(T.Q4_K)}, default=int(T.Q8_0), layers=2)
    for path, args, said in ((mamba, ["storage=gguf"], "gguf, offloaded: read quantized in place"), (gpt2, [], "")):
        done = _run([f"model.path={path}", *args], tmp_path, path.stem)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "same tokens as in memory: True" in done.stdout and said in done.stdout, done.stdout[-3000:]
    refused = _run([f"model.path={gpt2}", "storage=gguf"], tmp_path, "refused")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    said = [line for line in refused.stderr.splitlines() if line.startswith("offload_core: error: ")]
    assert len(said) == 1 and "cannot read architecture 'gpt2' in place" in said[0], refused.stderr[-3000:]
    assert "leave storage at its default" in said[0]
