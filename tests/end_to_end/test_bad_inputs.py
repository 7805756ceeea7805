"""A catalogue of bad inputs through ``run.py``'s entry: each ends in one line, exit 2, no traceback, and the user's
files unchanged.

Each case runs the CLI in this process (``hydra_main``, as ``python run.py`` does); a garbage ``.bin`` runs as a real
subprocess (tests/end_to_end/test_cli_errors.py holds a config error's real exit). The user's files (their checkpoint
copy, device maps, folders) are hashed before and after.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from offload_core.loading import sources
from offload_core.runner.cli import hydra_main
from tests import ROOT, preloaded
from tests.end_to_end.helpers import cli, snapshot


def _map(content) -> callable:
    def make(user: Path) -> list[str]:
        path = user / "map.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        return ["model=synthetic", f"device_map={path}"]

    return make


def _ckpt(breakage) -> callable:
    def make(user: Path) -> list[str]:
        ckpt = user / "my-model"
        ckpt.mkdir()
        shutil.copy(_tiny() / "config.json", ckpt / "config.json")  # the model is fine; its weights are not
        breakage(ckpt)
        return ["model=local", f"model.path={ckpt}"]

    return make


def _safetensors(header: dict, data_len: int) -> callable:
    def write(ckpt: Path) -> None:
        raw = json.dumps(header).encode()
        (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_len))

    return write


def _index(weight_map) -> callable:
    def write(ckpt: Path) -> None:
        save_file({"w": torch.ones(2)}, ckpt / "a.safetensors")
        (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return write


def _folder(setup) -> callable:
    def make(user: Path) -> list[str]:
        folder = user / "offload"
        setup(folder)
        return ["model=synthetic", "storage=memmap", f"offload_folder={folder}", "max_memory.cpu=1KiB", "headroom=0"]

    return make


def _foreign(folder: Path) -> None:
    folder.mkdir()
    (folder / "thesis.txt").write_text("only copy")


def _symlinked_lock(folder: Path) -> None:
    folder.mkdir()
    (folder.parent / "victim.txt").write_text("precious")
    (folder / ".lock").symlink_to(folder.parent / "victim.txt")


def _file_as_folder(folder: Path) -> None:
    folder.write_text("a file, not a folder")


S = "model=synthetic"
F32 = "F32"
CASES: dict[str, tuple[list[str] | callable, str]] = {
    # generation options
    "max_new_tokens=0": ([S, "max_new_tokens=0"], "max_new_tokens=0 must be at least 1"),
    "max_new_tokens=-1": ([S, "max_new_tokens=-1"], "max_new_tokens=-1 must be at least 1"),
    "temperature=-1": ([S, "do_sample=true", "temperature=-1"], "temperature=-1.0 must be a number above 0"),
    "temperature=0": ([S, "do_sample=true", "temperature=0"], "must be a number above 0"),
    "temperature=nan": ([S, "do_sample=true", "temperature=nan"], "must be a number above 0"),
    "temperature=inf": ([S, "do_sample=true", "temperature=inf"], "must be a number above 0"),
    "top_k=-5": ([S, "do_sample=true", "top_k=-5"], "top_k=-5 is negative"),
    "top_k=-1": ([S, "top_k=-1"], "top_k=-1 is negative"),
    "top_p=2": ([S, "do_sample=true", "top_p=2"], "top_p=2.0 must lie in (0, 1]"),
    "top_p=0": ([S, "top_p=0"], "must lie in (0, 1]"),
    "top_p=-0.5": ([S, "top_p=-0.5"], "must lie in (0, 1]"),
    "top_p=1.01": ([S, "top_p=1.01"], "must lie in (0, 1]"),
    "top_p=nan": ([S, "top_p=nan"], "must lie in (0, 1]"),
    "seed=huge": ([S, "seed=100000000000000000000000"], "seed=100000000000000000000000 is out of range"),
    "seed=-1": ([S, "seed=-1"], "seed=-1 is out of range"),
    "prompt=''": ([S, "prompt=''"], "prompt is empty"),
    "prompt=' '": ([S, "prompt='   '"], "prompt is empty"),
    "prompt=": ([S, "prompt="], "prompt is empty"),
    # sizes and budgets
    "max_memory.cpu=-5GB": ([S, "max_memory.cpu=-5GB"], "max_memory.cpu='-5GB' is negative"),
    "max_memory.cpu=-5": ([S, "max_memory.cpu=-5"], "max_memory.cpu=-5 is negative"),
    "max_memory.cpu=-1MiB": ([S, "max_memory.cpu=-1MiB"], "is negative"),
    "max_memory.cpu=lots": ([S, "max_memory.cpu=lots"], "is not a size"),
    "max_memory.cpu=10G": ([S, "max_memory.cpu=10G"], "is not a size"),
    "max_memory.cpu=1.5.5GB": ([S, "max_memory.cpu=1.5.5GB"], "is not a size"),
    "max_memory.cpu=2parsecs": ([S, "max_memory.cpu=2parsecs"], "is not a size"),
    "max_memory.cpu=0": ([S, "max_memory.cpu=0"], "leaves nothing to run with"),
    "max_memory.disk=-1GB": ([S, "max_memory.disk=-1GB"], "is negative"),
    "max_memory.cpu=true": ([S, "max_memory.cpu=true"], "is not a size"),
    "headroom=-1MiB": ([S, "headroom=-1MiB"], "headroom='-1MiB' is negative"),
    "headroom=abc": ([S, "headroom=abc"], "headroom='abc' is not a size"),
    "headroom>budget": ([S, "max_memory.cpu=10MiB", "headroom=20MiB"], "leaves nothing of max_memory.cpu"),
    "headroom=budget": ([S, "max_memory.cpu=10MiB", "headroom=10MiB"], "leaves nothing of max_memory.cpu"),
    "max_memory.0": ([S, "+max_memory.0=1GiB"], "a GPU budget on a CPU run"),
    "max_memory.tpu": ([S, "+max_memory.tpu=1GiB"], "unknown device 'tpu'"),
    "max_memory.mps": ([S, "+max_memory.mps=1GiB"], "unknown device 'mps'"),
    "promt=hi": ([S, "promt=hi"], "unknown key 'promt'"),
    "+foo=bar": ([S, "+foo=bar"], "unknown key 'foo'"),
    "max_new_tokens past the context": ([S, "max_new_tokens=100000000"], "exceed the model's context of 2048 tokens"),
    "no room without disk": ([S, "max_memory.cpu=100KiB", "max_memory.disk=0", "headroom=0"], "does not fit"),
    # devices and dtypes
    "execution_device=cuda:7": ([S, "execution_device=cuda:7"], "does not exist"),
    "execution_device=cuda": (
        [S, "execution_device=cuda"] if not torch.cuda.is_available() else [S, "execution_device=cuda:99"],
        "does not exist",
    ),
    "execution_device=toaster": ([S, "execution_device=toaster"], "is not a device"),
    "execution_device=mps": ([S, "execution_device=mps"], "is not supported"),
    "dtype=float8": ([S, "dtype=float8"], "dtype='float8' is unknown"),
    "dtype=int8": ([S, "dtype=int8"], "dtype='int8' is unknown"),
    "dtype=''": ([S, "dtype=''"], "is unknown"),
    # names and keys Hydra checks
    "hook.cpu_offload=half": ([S, "hook=functional_call", "hook.cpu_offload=half"], "is not a size"),
    # models
    "model.preset=huge": ([S, "model.preset=huge"], "synthetic preset 'huge' is unknown"),
    "model=local without path": (["model=local"], "model.path"),
    "model.path missing": (lambda user: ["model=local", f"model.path={user / 'nowhere'}"], "does not exist"),
    "model.path empty folder": (
        lambda user: (user / "empty").mkdir() or ["model=local", f"model.path={user / 'empty'}"],
        "has no usable config.json",
    ),
    "model.path without weights": (_ckpt(lambda c: None), "no weights found"),
    "no_split unknown class": ([S, "model.no_split_module_classes=[NopeLayer]"], "'NopeLayer', which the model lacks"),
    "no_split one unknown of two": ([S, "model.no_split_module_classes=[LlamaDecoderLayer,Blk]"], "'Blk'"),
    # device maps
    'map {"": 0}': (_map({"": 0}), "names GPU 0"),
    'map {"": "mps"}': (_map({"": "mps"}), "'': 'mps' is not a device this run can use"),
    'map {"": "cuda:3"}': (_map({"": "cuda:3"}), "names GPU 3"),
    'map {"": 7}': (_map({"": 7}), "names GPU 7"),
    'map {"": "tpu"}': (_map({"": "tpu"}), "unknown device(s)"),
    'map {"": true}': (_map({"": True}), "unknown device(s)"),
    "map list": (_map(["cpu"]), "must hold a JSON object"),
    "map not json": (_map("{nope"), "is not valid JSON"),
    "map unknown module": (_map({"": "cpu", "model.layers.99": "cpu"}), "which the model does not have"),
    "map empty": (_map({}), "covers no device for"),
    "map missing file": (lambda user: [S, f"device_map={user / 'none.json'}"], "cannot be read"),
    # checkpoints
    "safetensors overlap behind 0-byte": (
        _ckpt(
            _safetensors(
                {
                    "a": {"dtype": F32, "shape": [25], "data_offsets": [0, 100]},
                    "z": {"dtype": F32, "shape": [0], "data_offsets": [50, 50]},
                    "b": {"dtype": F32, "shape": [25], "data_offsets": [50, 150]},
                },
                150,
            )
        ),
        "overlap",
    ),
    "safetensors nested": (
        _ckpt(
            _safetensors(
                {
                    "a": {"dtype": F32, "shape": [50], "data_offsets": [0, 200]},
                    "b": {"dtype": F32, "shape": [5], "data_offsets": [10, 30]},
                },
                200,
            )
        ),
        "overlap",
    ),
    "safetensors past the end": (
        _ckpt(_safetensors({"a": {"dtype": F32, "shape": [50], "data_offsets": [0, 200]}}, 20)),
        "is truncated",
    ),
    "safetensors bad dtype": (
        _ckpt(_safetensors({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, 1)),
        "which this torch build cannot read",
    ),
    "safetensors negative shape": (
        _ckpt(_safetensors({"a": {"dtype": F32, "shape": [-1], "data_offsets": [0, 4]}}, 4)),
        "not a list of non-negative ints",
    ),
    "safetensors wrong span": (
        _ckpt(_safetensors({"a": {"dtype": F32, "shape": [2], "data_offsets": [0, 4]}}, 4)),
        "needs 8 bytes",
    ),
    "safetensors header garbage": (
        _ckpt(lambda c: (c / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{{{{{")),
        "not valid JSON",
    ),
    "safetensors too short": (_ckpt(lambda c: (c / "model.safetensors").write_bytes(b"\x01")), "is truncated"),
    "safetensors header huge": (
        _ckpt(lambda c: (c / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")),
        "header claims",
    ),
    "index escapes folder": (_ckpt(_index({"w": "../elsewhere.safetensors"})), "not a file inside that folder"),
    "index absolute shard": (_ckpt(_index({"w": "/etc/hostname"})), "not a file inside that folder"),
    "index not json": (
        _ckpt(lambda c: (c / "model.safetensors.index.json").write_text("{nope")),
        "is not a valid index",
    ),
    "index missing shard": (_ckpt(_index({"w": "b.safetensors"})), "but the file is missing"),
    "index wrong shard": (_ckpt(_index({"v": "a.safetensors"})), "which has no such tensor"),
    "bin random bytes": (
        _ckpt(lambda c: (c / "pytorch_model.bin").write_bytes(bytes(range(1, 128)) * 30)),
        "is not a PyTorch weights file",
    ),
    "bin empty": (_ckpt(lambda c: (c / "pytorch_model.bin").write_bytes(b"")), "pytorch_model.bin"),
    "bin not a dict": (
        _ckpt(lambda c: torch.save([torch.ones(2)], c / "pytorch_model.bin")),
        "is not a flat state dict",
    ),
    # offload folders
    "offload folder foreign": (_folder(_foreign), "holds files offload_core did not create"),
    "offload folder symlinked .lock": (_folder(_symlinked_lock), "holds a symlink (.lock)"),
    "offload folder is a file": (_folder(_file_as_folder), "offload_folder"),
}


def _tiny() -> Path:
    return sources.synthetic_checkpoint(**sources.synthetic_preset("tiny"))


#: unknown options, misspelled keys and wrong types: Hydra finds these when it composes the config, which the
#: command line does once before the run (one line, exit code 2, as every other bad input)
HYDRA_CASES: dict[str, tuple[list[str], str]] = {
    "max_new_tokens=abc": ([S, "max_new_tokens=abc"], "could not be converted to Integer"),
    "max_new_tokens=1.5": ([S, "max_new_tokens=1.5"], "could not be converted to Integer"),
    "temperature=warm": ([S, "temperature=warm"], "could not be converted to Float"),
    "top_k=1.5": ([S, "top_k=1.5"], "could not be converted to Integer"),
    "seed=abc": ([S, "seed=abc"], "could not be converted to Integer"),
    "do_sample=perhaps": ([S, "do_sample=perhaps"], "do_sample"),
    "placement=nope": ([S, "placement=nope"], "placement=nope is not an option of placement: use one of"),
    "storage=ssd": ([S, "storage=ssd"], "storage=ssd is not an option of storage: use one of"),
    "hook=magic": ([S, "hook=magic"], "hook=magic is not an option of hook: use one of"),
    "model=nope": (["model=nope"], "model=nope is not an option of model: use one of"),
    "hook.granularty": ([S, "hook.granularty=block"], "unknown key 'granularty' in hook.granularty"),
    "storage.verify=maybe": ([S, "storage=memmap", "storage.verify=maybe"], "verify"),
    "model.chat_template=maybe": ([S, "model.chat_template=maybe"], "chat_template"),
}
HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."


#: the configurations of the cases that are found bad only once the run has planned (an offload folder's contents):
#: the calibration of the time prediction comes before that, and a run that calibrates says so on a line of its own
CALIBRATED = [[S], [S, "storage=memmap", "max_memory.cpu=1KiB", "headroom=0"]]


@pytest.fixture(scope="module", autouse=True)
def _tiny_built(tmp_path_factory) -> None:
    """The tiny checkpoint built, and :data:`CALIBRATED` calibrated by a good run of each (in this process, as the
    cases run), so that a case says only its error line whichever test ran before it."""
    _tiny()
    runs = tmp_path_factory.mktemp("calibrated")
    for i, args in enumerate(CALIBRATED):
        argv = ["run.py", "progress=false", "max_new_tokens=1", f"hydra.run.dir={runs / str(i)}", *args]
        with (
            mock.patch.object(sys, "argv", argv),
            redirect_stdout(io.StringIO()),
            redirect_stderr(io.StringIO()) as err,
        ):
            try:
                hydra_main()
            except SystemExit as exit_:
                raise AssertionError(f"{argv}: exit {exit_.code}: {err.getvalue()[-2000:]}") from None


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input_ends_in_one_line_exit_2_and_changes_nothing(case, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    args, expected = case
    user = tmp_path / "user"
    user.mkdir()
    args = args(user) if callable(args) else args
    before = snapshot(user)
    links = {p: os.readlink(p) for p in user.rglob("*") if p.is_symlink()}
    code, err = cli(args, tmp_path, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offload_core: error: "), err
    assert expected in lines[0], lines[0]
    assert snapshot(user) == before
    assert {p: os.readlink(p) for p in user.rglob("*") if p.is_symlink()} == links


@pytest.mark.parametrize("case", HYDRA_CASES.values(), ids=HYDRA_CASES.keys())
def test_what_hydra_finds_is_one_line_too(case, tmp_path, capsys):
    args, expected = case
    code, err = cli(args, tmp_path, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("offload_core: error: "), err
    assert expected in lines[0] and HYDRA_HINT not in err and "Traceback" not in err, err


def test_the_catalogue_is_large_enough():
    assert len(CASES) >= 80


def test_a_garbage_bin_prints_no_progress_fragment_before_the_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(
        sources.synthetic_checkpoint(**sources.synthetic_preset("tiny")),
        ckpt,
        ignore=shutil.ignore_patterns("*.safetensors*"),
    )
    (ckpt / "pytorch_model.bin").write_bytes(bytes(range(1, 128)) * 30)
    proc = preloaded.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "model=local",
            f"model.path={ckpt}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HYDRA_FULL_ERROR": "0", "TQDM_DISABLE": "1"},
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("offload_core: error: ") and proc.stderr.count("\n") == 1, proc.stderr
