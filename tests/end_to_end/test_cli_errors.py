"""Every mistake a user can make through ``run.py`` ends with one clear line, a non-zero exit and their files unchanged.

The CLI runs in this process (``hydra_main`` with a patched ``sys.argv``): the same code path as
``python run.py``, without paying for a fresh interpreter per case. One subprocess checks the real exit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload_core.loading import sources

from tests import ROOT, preloaded
from tests.end_to_end.helpers import assert_one_line, cli, snapshot


@pytest.fixture(scope="module")
def tiny() -> Path:
    return sources.synthetic_checkpoint(**sources.synthetic_preset("tiny"))


@pytest.fixture
def user_ckpt(tiny, tmp_path) -> Path:
    """The user's own checkpoint folder (a copy of the tiny synthetic Llama we may break)."""
    target = tmp_path / "my-model"
    shutil.copytree(tiny, target)
    return target


# -- config -------------------------------------------------------------------------------------

# unknown options, misspelled keys and wrong types: tests/end_to_end/test_bad_inputs.py (HYDRA_CASES)


@pytest.mark.parametrize(
    "args,parts",
    [
        (["max_memory.cpu=-5"], ["max_memory.cpu=-5 is negative"]),
        (["max_memory.cpu=0"], ["max_memory.cpu=0 leaves nothing to run with"]),
        (["max_memory.cpu=lots"], ["max_memory.cpu='lots' is not a size", "GiB"]),
        (["max_memory.cpu=10G"], ["max_memory.cpu='10G' is not a size", "KiB, MiB, GiB, TiB"]),
        (["max_memory.cpu=2parsecs"], ["is not a size"]),
        (["headroom=-1MiB"], ["headroom='-1MiB' is negative"]),
        (["+max_memory.0=1GiB"], ["max_memory.0: a GPU budget on a CPU run"]),
        (["max_memory.0=1GiB"], ["max_memory.0: a GPU budget on a CPU run"]),
        (["promt=hi"], ["unknown key 'promt' in 'promt=hi'", "prompt"]),
        (["+max_memory.tpu=1GiB"], ["max_memory has an unknown device 'tpu'"]),
        (["execution_device=cuda:7"], ["execution_device='cuda:7' does not exist", "use cpu"]),
        (["execution_device=toaster"], ["execution_device='toaster' is not a device"]),
        (["dtype=float8"], ["dtype='float8' is unknown", "bfloat16"]),
        (["hook=functional_call", "hook.cpu_offload=half"], ["hook.cpu_offload='half' is not a size"]),
        (["model.preset=huge"], ["synthetic preset 'huge' is unknown", "tiny"]),
        (
            ["max_memory.cpu=100KiB", "max_memory.disk=0", "headroom=0"],
            [
                "does not fit in max_memory.cpu=100.00 KiB",
                "largest unsplittable layer",
                "more bytes are needed",
                "set max_memory.cpu to at least",
                "allow disk",
            ],
        ),
    ],
)
def test_bad_config_values_fail_with_one_line(args, parts, tmp_path, capsys, monkeypatch):
    if any(a.startswith("execution_device=cuda") for a in args) and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that GPU")
    code, err = cli(["model=synthetic", *args], tmp_path, capsys)
    assert code == 2, err
    assert_one_line(err, *parts)


def test_no_disk_with_a_budget_that_fits_runs(tmp_path, capsys):
    code, err = cli(["model=synthetic", "max_memory.cpu=200MiB", "max_memory.disk=0"], tmp_path, capsys)
    assert code == 0, err
    metrics = json.loads((tmp_path / "hydra" / "metrics.json").read_text())
    assert "disk" not in metrics["devices"]


def test_hydra_full_error_gives_the_traceback(tmp_path, capsys, monkeypatch):
    from offload_core.errors import ConfigError

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError, match="is negative"):
        cli(["model=synthetic", "max_memory.cpu=-5"], tmp_path, capsys)


def test_a_process_of_its_own_exits_2_with_a_single_line(tmp_path):
    proc = preloaded.run(
        [sys.executable, str(ROOT / "run.py"), "model=synthetic", "dtype=float8", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == "offload_core: error: dtype='float8' is unknown: use one of auto, bf16, bfloat16, "
        "float, float16, float32, float64, fp16, fp32, half"
    )


# -- device maps given by the user --------------------------------------------------------------


@pytest.mark.parametrize(
    "content,parts",
    [
        ({"": "cpu", "model.layers.9": "cpu"}, ["'model.layers.9', which the model does not have"]),
        ({"model.embed_tokens": "cpu", "model.layers": "disk"}, ["covers no device for", "'lm_head.weight'"]),
        (
            {"model": "cpu", "model.layers.0": "disk", "lm_head": "cpu"},
            ["keys overlap with different devices", "'model.layers.0' (disk) inside 'model' (cpu)"],
        ),
        ({"": "tpu"}, ["unknown device(s) '': 'tpu'"]),
        ({"": True}, ["unknown device(s) '': True"]),
        (["cpu"], ["must hold a JSON object"]),
        ("{not json", ["is not valid JSON"]),
        (None, ["cannot be read"]),
    ],
)
def test_bad_device_map_files(content, parts, tmp_path, capsys):
    path = tmp_path / "map.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        before = snapshot(tmp_path)
    code, err = cli(["model=synthetic", f"device_map={path}"], tmp_path, capsys)
    assert code == 2, err
    assert_one_line(err, *parts)
    if content is not None:
        assert path.read_bytes() == (content if isinstance(content, str) else json.dumps(content)).encode()
        assert {k: v for k, v in snapshot(tmp_path).items() if k == "map.json"} == {"map.json": before["map.json"]}


# -- checkpoints --------------------------------------------------------------------------------


def _shard(ckpt: Path, i: int) -> Path:
    return ckpt / f"model-0000{i}-of-00004.safetensors"


def _truncate(ckpt: Path) -> None:
    shard = _shard(ckpt, 2)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _absurd_header(ckpt: Path) -> None:
    shard = _shard(ckpt, 3)
    data = shard.read_bytes()
    shard.write_bytes((2**62).to_bytes(8, "little") + data[8:])


def _rewrite(ckpt: Path, change) -> None:
    shard = _shard(ckpt, 1)
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def _wrong_shape(ckpt: Path) -> None:
    _rewrite(ckpt, lambda t: t.__setitem__("model.embed_tokens.weight", torch.zeros(1024, 64, dtype=torch.bfloat16)))


def _wrong_kind(ckpt: Path) -> None:
    _rewrite(ckpt, lambda t: t.__setitem__("model.embed_tokens.weight", torch.zeros(1024, 128, dtype=torch.int16)))


def _duplicate(ckpt: Path) -> None:
    (ckpt / "model.safetensors.index.json").unlink()
    save_file({"model.norm.weight": torch.ones(128, dtype=torch.bfloat16)}, ckpt / "extra.safetensors")


def _missing_shard(ckpt: Path) -> None:
    _shard(ckpt, 4).unlink()


def _no_weights(ckpt: Path) -> None:
    for p in ckpt.glob("model*"):
        p.unlink()


class _Payload:
    """Unpickling this creates ``marker``: it stands in for any code a hostile pickle could run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize(
    "breakage,parts",
    [
        (_truncate, ["model-00002-of-00004.safetensors is", "re-download or re-convert"]),
        (_absurd_header, ["is not a valid safetensors file: its header claims 4611686018427387904 bytes"]),
        (_missing_shard, ["names shard model-00004-of-00004.safetensors", "but the file is missing"]),
        (_duplicate, ["tensor 'model.norm.weight' is in both", "extra.safetensors"]),
        (_no_weights, ["no weights found in"]),
        (_wrong_shape, ["'model.embed_tokens.weight'", "has shape [1024, 64] but the model expects [1024, 128]"]),
        (_wrong_kind, ["'model.embed_tokens.weight'", "is int16 but the model expects a floating-point tensor"]),
    ],
)
def test_broken_checkpoints_fail_with_one_line_and_stay_unchanged(breakage, parts, user_ckpt, tmp_path, capsys):
    breakage(user_ckpt)
    before = snapshot(user_ckpt)
    code, err = cli(["model=local", f"model.path={user_ckpt}", "max_memory.cpu=1MiB", "headroom=0"], tmp_path, capsys)
    assert code == 2, err
    assert_one_line(err, *parts)
    assert snapshot(user_ckpt) == before


def test_missing_and_empty_checkpoint_folders(tmp_path, capsys):
    code, err = cli(["model=local", f"model.path={tmp_path / 'nowhere'}"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "does not exist", "give a local Hugging Face checkpoint folder")
    (tmp_path / "empty").mkdir()
    code, err = cli(["model=local", f"model.path={tmp_path / 'empty'}"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "has no usable config.json", "point model.path at a Hugging Face checkpoint folder")
    assert os.listdir(tmp_path / "empty") == []


def test_a_pickle_that_would_run_code_is_refused_never_executed(tiny, tmp_path, capsys):
    ckpt = tmp_path / "legacy"
    ckpt.mkdir()
    shutil.copy(tiny / "config.json", ckpt / "config.json")
    marker = tmp_path / "pwned"
    torch.save({"model.norm.weight": torch.ones(128), "x": _Payload(str(marker))}, ckpt / "pytorch_model.bin")
    before = snapshot(ckpt)
    code, err = cli(["model=local", f"model.path={ckpt}"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "pytorch_model.bin contains Python objects beyond tensors; refusing to unpickle it")
    assert not marker.exists()
    assert snapshot(ckpt) == before


# -- offload folders ----------------------------------------------------------------------------


def _offload_args(tiny: Path, folder: Path) -> list[str]:
    return [
        "model=local",
        "storage=memmap",
        f"model.path={tiny}",
        "max_memory.cpu=1MiB",
        "headroom=0",
        f"offload_folder={folder}",
    ]


def test_offload_folder_holding_foreign_files_is_refused_and_untouched(tiny, tmp_path, capsys):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "thesis.tex").write_text("my only copy")
    (folder / "weights.dat").write_bytes(b"\x00" * 64)
    before = snapshot(folder)
    code, err = cli(_offload_args(tiny, folder), tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "holds files offload_core did not create", "give an empty or new folder")
    assert snapshot(folder) == before and sorted(os.listdir(folder)) == ["thesis.tex", "weights.dat"]


def test_offload_folder_that_cannot_be_created(tiny, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    code, err = cli(_offload_args(tiny, blocker / "offload"), tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "cannot create offload_folder", "choose a writable folder")
    assert blocker.read_text() == "mine"


def test_offload_folder_not_writable(tiny, tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:
        # root ignores permission bits: a read-only mount is the only way to say no to it.
        if (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True
            ).returncode
            != 0
        ):
            pytest.skip("running as root and mounting is not permitted")
    else:
        folder.chmod(0o555)
    try:
        code, err = cli(_offload_args(tiny, folder), tmp_path, capsys)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(folder)], check=True)
        else:
            folder.chmod(0o755)
    assert code == 2
    assert_one_line(err, f"offload_folder {folder} is not writable")


def test_offload_index_escaping_the_folder_is_rebuilt_never_followed(tiny, tmp_path, capsys):
    folder = tmp_path / "off"
    assert cli(_offload_args(tiny, folder), tmp_path, capsys)[0] == 0
    index = json.loads((folder / "index.json").read_text())
    first = next(iter(index))
    index["../../victim"] = index.pop(first)
    (folder / "index.json").write_text(json.dumps(index))
    victim = tmp_path / "victim.dat"
    victim.write_bytes(b"precious")
    code, err = cli(_offload_args(tiny, folder), tmp_path, capsys)
    assert code == 0, err  # the edited index fails verification: the folder is rebuilt
    assert "failed verification" in err and "Traceback" not in err
    assert json.loads((tmp_path / "hydra" / "metrics.json").read_text())["store_reused"] is False
    assert victim.read_bytes() == b"precious"


def test_offload_folder_from_another_checkpoint_is_detected_and_rebuilt(tiny, user_ckpt, tmp_path, capsys):
    folder = tmp_path / "off"
    (tmp_path / "keep").mkdir()
    assert cli(_offload_args(tiny, folder), tmp_path, capsys)[0] == 0
    first = json.loads((tmp_path / "hydra" / "metrics.json").read_text())
    assert first["store_reused"] is False
    (folder / "notes.txt").write_text("added by me later")
    # Another checkpoint (another path, other bytes) with the same tensor names and shapes.
    _rewrite(user_ckpt, lambda t: t.__setitem__("model.embed_tokens.weight", t["model.embed_tokens.weight"] * 2))
    before = snapshot(user_ckpt)
    assert cli(_offload_args(user_ckpt, folder), tmp_path, capsys)[0] == 0
    other = json.loads((tmp_path / "hydra" / "metrics.json").read_text())
    assert other["store_reused"] is False and other["store_bytes_written"] > 0
    assert cli(_offload_args(user_ckpt, folder), tmp_path, capsys)[0] == 0
    again = json.loads((tmp_path / "hydra" / "metrics.json").read_text())
    assert again["store_reused"] is True and again["token_ids"] == other["token_ids"]
    assert (folder / "notes.txt").read_text() == "added by me later"
    assert snapshot(user_ckpt) == before
