"""Faults survived: kill -9 while writing, a full disk, Ctrl-C, two runs on one offload folder, and 2,000 forward calls
per policy."""

from __future__ import annotations

import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from offload_core.loading import sources
from offload_core.storage import StoreContext
from offload_core.errors import StorageError
from offload_core.storage.folder import COMPLETE, FolderStore
from tests.end_to_end.helpers import (
    assert_one_line,
    child_env,
    cli,
    run_args,
    run_metrics,
    snapshot,
    wait_for_line,
)

from tests.waits import wait_until


@pytest.fixture(scope="module")
def tiny() -> Path:
    return sources.synthetic_checkpoint(**sources.synthetic_preset("tiny"))


# -- kill -9 while the offload folder is being written ------------------------------------------

_KILLED_WRITER = textwrap.dedent("""
    import os, sys, time
    from offload_core.storage.folder import FolderStore
    real, count = FolderStore.write_file, [0]

    def slow_write(path, data):  # counts the writes into the run's folder (not the calibration probe's)
        count[0] += os.path.dirname(os.path.abspath(path)) == os.environ["KILLED_FOLDER"]
        if count[0] == 3:  # half of the third tensor's bytes land, then we stall until killed
            real(path, data)
            os.truncate(path, len(data) // 2)
            print("HALF-WRITTEN", flush=True)
            time.sleep(600)
        real(path, data)

    FolderStore.write_file = staticmethod(slow_write)
    from offload_core.runner.cli import hydra_main
    sys.argv = ["run.py", *sys.argv[1:]]
    hydra_main()
""")


def test_kill_9_mid_write_is_detected_and_rebuilt(tiny, tmp_path, capsys):
    folder = tmp_path / "off"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _KILLED_WRITER,
            *run_args(tiny, folder),
            "progress=false",
            f"hydra.run.dir={tmp_path / 'killed'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**child_env(), "KILLED_FOLDER": str(folder.resolve())},
    )
    wait_for_line(proc, "HALF-WRITTEN")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    leftovers = set(os.listdir(folder))
    assert COMPLETE not in leftovers and any(n.endswith(".dat.tmp") for n in leftovers)

    code, err = cli(run_args(tiny, folder), tmp_path, capsys)
    assert code == 0, err
    rebuilt = run_metrics(tmp_path)
    assert rebuilt["store_reused"] is False
    assert not any(n.endswith(".tmp") for n in os.listdir(folder))
    # The data is right: same tokens as a run with a fresh temporary folder, then as a reusing run.
    assert cli(run_args(tiny), tmp_path, capsys)[0] == 0
    assert run_metrics(tmp_path)["token_ids"] == rebuilt["token_ids"]
    assert cli(run_args(tiny, folder), tmp_path, capsys)[0] == 0
    assert run_metrics(tmp_path)["store_reused"] is True and run_metrics(tmp_path)["token_ids"] == rebuilt["token_ids"]


def test_an_unfinished_folder_is_never_read(tmp_path):
    folder = tmp_path / "off"
    store = FolderStore(StoreContext(names=["a", "b"], offload_folder=folder, fingerprint={"v": 1}))
    store.put("a", torch.arange(8.0))
    store.close()  # the run stops here: no finalize, so no completion marker
    again = FolderStore(StoreContext(names=["a", "b"], offload_folder=folder, fingerprint={"v": 1}))
    assert not again.reused and len(again) == 0
    again.close()


# -- disk full ----------------------------------------------------------------------------------


def _mount_small_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if os.geteuid() != 0:
        return False
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, timeout=60
        ).returncode
        == 0
    )


def _assert_disk_full_handled(code: int, err: str, disk: Path, ckpt_before: dict, tiny: Path) -> None:
    assert code == 2, err
    assert_one_line(
        err,
        "no space left on the device of offload_folder",
        "free space or point offload_folder at a larger disk",
        "the partial offload folder was removed",
    )
    assert not (disk / "off").exists()  # the folder we made is gone with everything in it
    assert (disk / "mine.txt").read_text() == "the user's file"
    assert snapshot(tiny) == ckpt_before


def test_disk_full_on_a_small_filesystem(tiny, tmp_path, capsys):
    disk = tmp_path / "disk"
    if not _mount_small_tmpfs(disk, "512k"):
        pytest.skip("mounting a small tmpfs is not permitted here (the injected ENOSPC test covers this)")
    try:
        (disk / "mine.txt").write_text("the user's file")
        before = snapshot(tiny)
        code, err = cli(run_args(tiny, disk / "off"), tmp_path, capsys)  # 1.6 MiB to write, 512 KiB of room
        _assert_disk_full_handled(code, err, disk, before, tiny)
    finally:
        subprocess.run(["umount", str(disk)], check=True, timeout=60)


def test_disk_full_injected_enospc(tiny, tmp_path, capsys, monkeypatch):
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "mine.txt").write_text("the user's file")
    real, room = FolderStore.write_file, [600_000]

    def filling(path, data):
        size = len(data)
        if size > room[0]:
            real(path, data)
            os.truncate(path, room[0])  # the part that fit, as a real full disk leaves it
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        room[0] -= size
        real(path, data)

    monkeypatch.setattr(FolderStore, "write_file", staticmethod(filling))
    before = snapshot(tiny)
    code, err = cli(run_args(tiny, disk / "off"), tmp_path, capsys)
    _assert_disk_full_handled(code, err, disk, before, tiny)


def test_disk_full_in_an_existing_folder_keeps_the_users_files(tmp_path, monkeypatch):
    folder = tmp_path / "off"
    store = FolderStore(StoreContext(names=["a"], offload_folder=folder, fingerprint={"v": 1}))
    store.put("a", torch.ones(4))
    store.finalize()
    store.close()
    (folder / "notes.md").write_text("mine")

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(FolderStore, "write_file", staticmethod(full))
    store = FolderStore(StoreContext(names=["a"], offload_folder=folder, fingerprint={"v": 2}))
    with pytest.raises(StorageError, match="no space left"):
        store.put("a", torch.ones(4))
    store.close()
    assert sorted(os.listdir(folder)) == ["notes.md"]


# -- Ctrl-C -------------------------------------------------------------------------------------


# Ctrl-C during generation (exit 130, one line, the temporary files removed): test_interrupted_answer.py


def test_ctrl_c_during_loading_removes_the_temporary_folder(tiny, tmp_path, capsys, monkeypatch):
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    real, count = FolderStore.write_file, [0]

    def interrupted(path, data):
        count[0] += 1
        if count[0] == 4:
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(FolderStore, "write_file", staticmethod(interrupted))
    code, err = cli(run_args(tiny), tmp_path, capsys)
    assert code == 130
    assert "interrupted (Ctrl-C)" in err and "Traceback" not in err
    assert count[0] == 4 and os.listdir(scratch) == []


# -- two runs, one offload folder ---------------------------------------------------------------

_HOLDER = textwrap.dedent("""
    import sys, torch
    from offload_core.storage import StoreContext
    from offload_core.storage.folder import FolderStore
    store = FolderStore(StoreContext(names=["w"], offload_folder=sys.argv[1], fingerprint={"v": 1}))
    store.put("w", torch.arange(1000.0))
    store.finalize()
    print("HOLDING", flush=True)
    sys.stdin.readline()
    store.close()
    print("RELEASED", flush=True)
""")


def test_a_second_run_on_the_same_folder_waits_and_says_why(tmp_path, capsys):
    folder = tmp_path / "shared"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        wait_for_line(holder, "HOLDING")
        opened: list[FolderStore] = []
        second = threading.Thread(
            target=lambda: opened.append(
                FolderStore(StoreContext(names=["w"], offload_folder=folder, fingerprint={"v": 1}))
            )
        )
        second.start()
        said = []  # what this process printed to stderr meanwhile (the second run says why it waits)
        wait_until(
            lambda: said.append(capsys.readouterr().err) or "waiting for it to finish" in "".join(said),
            "the second run saying it waits",
        )
        assert second.is_alive() and not opened  # waiting for the first run, not writing under it
        holder.stdin.write("go\n")
        holder.stdin.flush()
        second.join(timeout=30)
        assert opened, "the second run never got the folder"
        store = opened[0]
        assert store.reused and torch.equal(store["w"], torch.arange(1000.0))
        store.close()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    err = "".join(said) + capsys.readouterr().err
    assert f"offload_folder {folder} is in use by another run (pid {holder.pid}); waiting for it to finish" in err


# -- 2,000 forward calls per module-hook policy -------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def anon_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
@pytest.mark.parametrize("policy", ["align_per_call", "chained", "functional_call", "prefetch"])
def test_2000_forward_calls_keep_memory_and_file_descriptors_flat(policy, tmp_path):
    from offload_core import dispatch_model

    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 16)
    with torch.inference_mode():
        expected = model(x)
    device_map = {
        "embed": "cpu",
        "blocks.0": "cpu",
        "blocks.1": "disk",
        "blocks.2": "disk",
        "blocks.3": "disk",
        "head": "cpu",
    }
    dispatch_model(
        model, device_map, storage="memmap", policy=policy, offload_folder=tmp_path / "off", execution_device="cpu"
    )
    # the new folder is sealed by a thread of the lowest priority, which opens each file while it checksums it
    model.offload_state.store.wait_until_sealed()
    with torch.inference_mode():
        for _ in range(100):  # warm up: caches, maps and threads settle
            model(x)
        gc.collect()
        rss, fds = anon_rss(), open_fds()
        for _ in range(2000):
            out = model(x)
        gc.collect()
        grown, fds_after = anon_rss() - rss, open_fds()
    assert torch.allclose(out, expected)
    model.offload_state.remove()
    assert grown < 4 * 2**20, f"{policy}: anonymous RSS grew {grown} bytes over 2,000 calls"
    assert fds_after <= fds, f"{policy}: {fds_after - fds} file descriptors leaked over 2,000 calls"
