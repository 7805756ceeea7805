"""How streamed blocks are best read on this disk: mapped pages (``MADV_POPULATE_READ``, dropped after with
``MADV_DONTNEED`` + ``POSIX_FADV_DONTNEED``), the same with ``POSIX_FADV_WILLNEED`` on the next block, buffered
``preadv``, and ``O_DIRECT`` reads into an aligned buffer; figures written to bench/results/readpath-<preset>.{json,md}.

    OFFLOAD_CORE_CACHE=/tmp/bigcache flock /tmp/bench.lock python bench/readpath.py --preset 30b
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from keep import checkpoint_files  # noqa: E402
from pagecache import cached_fraction, drop_cache  # noqa: E402

GB = 1e9
MIB = 1 << 20


def blocks_of(path: Path, count: int) -> list[list[tuple[str, int, int]]]:
    """The last ``count`` whole decoder blocks of shard ``path``: per block, its tensors' (key, start, end) in file
    order."""
    from offload_core.loading.safetensors_file import SafetensorsFile

    shard = SafetensorsFile(path)
    blocks: dict[str, list[tuple[str, int, int]]] = {}
    for key in shard.keys():
        layer = re.search(r"layers\.(\d+)\.", key)
        if layer:
            blocks.setdefault(layer.group(1), []).append((key, *shard.byte_range(key)))
    whole = list(blocks.values())[1:]  # a shard's first block may have begun in the shard before
    return whole[-count:]


def mapped(path: Path, blocks: list, willneed: bool, exact: bool = False) -> int:
    """Today's streamed path: each tensor's mapped pages read in with MADV_POPULATE_READ, dropped after use
    (``willneed``: the next block's span advised a block ahead; ``exact``: each tensor's own byte range
    advised just before it is read in, so the faults find their pages in flight and read nothing around them)."""
    from offload_core.loading.safetensors_file import SafetensorsFile
    from offload_core.storage.pagecache import drop, populate

    shard = SafetensorsFile(path)
    fd = os.open(path, os.O_RDONLY)
    total = 0
    try:
        for i, block in enumerate(blocks):
            if willneed and i + 1 < len(blocks):  # the next block's span, as the reader would ask a block ahead
                nxt = blocks[i + 1]
                os.posix_fadvise(fd, nxt[0][1], nxt[-1][2] - nxt[0][1], os.POSIX_FADV_WILLNEED)
            for key, start, end in block:
                tensor = shard.get(key)
                if exact:
                    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
                populate(tensor)
                total += end - start
            for key, start, _ in block:
                drop(shard.get(key), path, start)
    finally:
        os.close(fd)
    return total


def _read_bytes() -> int:
    return psutil.Process().io_counters().read_bytes


def _aligned_buffer(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)  # anonymous memory: page aligned, as O_DIRECT asks


def pread(path: Path, blocks: list, direct: bool, chunk: int) -> int:
    """Each block's span read front to back in ``chunk``-byte requests into one aligned buffer (O_DIRECT:
    the span widened to page boundaries; buffered: the span's cached pages dropped after)."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    buffer = _aligned_buffer(chunk)
    view = memoryview(buffer)
    total = 0
    try:
        for block in blocks:
            start, end = block[0][1], block[-1][2]
            if direct:
                start, end = start - start % mmap.PAGESIZE, -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
            offset = start
            while offset < end:
                n = os.preadv(fd, [view[:chunk]], offset)
                if n <= 0:
                    break
                offset += n
            total += block[-1][2] - block[0][1]
            if not direct:
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
    finally:
        view.release()
        buffer.close()
        os.close(fd)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--preset", default="30b")
    parser.add_argument(
        "--blocks", type=int, default=2, help="decoder blocks read per method (the last ones of a late shard)"
    )
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    files = checkpoint_files(args.preset)
    path = files[-2]
    blocks = blocks_of(path, args.blocks)
    methods = {
        "mapped, populate + drop (today)": lambda: mapped(path, blocks, willneed=False),
        "mapped, WILLNEED a block ahead + populate + drop": lambda: mapped(path, blocks, willneed=True),
        "mapped, WILLNEED each tensor's range + populate + drop": lambda: mapped(
            path, blocks, willneed=False, exact=True
        ),
        "buffered preadv 8 MiB + FADV_DONTNEED": lambda: pread(path, blocks, direct=False, chunk=8 * MIB),
        "O_DIRECT preadv 8 MiB": lambda: pread(path, blocks, direct=True, chunk=8 * MIB),
        "O_DIRECT preadv 64 MiB": lambda: pread(path, blocks, direct=True, chunk=64 * MIB),
    }
    rows = []
    for repeat in range(args.repeats):
        for name, method in methods.items():
            drop_cache([path])
            read0, cpu0, wall0 = _read_bytes(), os.times(), time.perf_counter()
            total = method()
            wall, cpu1, read = time.perf_counter() - wall0, os.times(), _read_bytes() - read0
            cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
            left = cached_fraction([path])
            rows.append(
                {
                    "method": name,
                    "repeat": repeat,
                    "bytes": total,
                    "seconds": wall,
                    "gb_per_s": total / wall / GB,
                    "cpu_s_per_gb": cpu / (total / GB),
                    "disk_read_per_byte": read / total,
                    "cached_after": left,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    results = REPO / "bench" / "results"
    stem = f"readpath-{args.preset}"
    (results / f"{stem}.json").write_text(json.dumps({"args": vars(args), "file": path.name, "rows": rows}, indent=1))
    cache = f"OFFLOAD_CORE_CACHE={os.environ['OFFLOAD_CORE_CACHE']} " if os.environ.get("OFFLOAD_CORE_CACHE") else ""
    lines = [
        f"# Read path of streamed blocks: `{args.preset}`, the last {args.blocks} blocks of {path.name} "
        f"({rows[0]['bytes'] / GB:.2f} GB), cache dropped before each",
        "",
        f"Reproduce: `{cache}flock /tmp/bench.lock python bench/readpath.py {' '.join(sys.argv[1:])}`",
        "",
        "| method | repeat | GB/s | CPU s per GB | disk bytes read per byte wanted | cached after |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {r['repeat']} | {r['gb_per_s']:.2f} | {r['cpu_s_per_gb']:.2f} | "
        f"{r['disk_read_per_byte']:.3f} | {r['cached_after']:.3f} |"
        for r in rows
    ]
    (results / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {results / stem}.md")


if __name__ == "__main__":
    main()
