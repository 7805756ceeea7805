"""``transformers serve`` with its model loaded by an accelerate device map at a CPU budget, the rest on disk.

transformers' server has no flag for ``max_memory`` or ``offload_folder``: its model manager calls
``from_pretrained(model_id, device_map=<--device>, ...)``. This wrapper adds ``max_memory={"cpu": <budget>}``
and ``offload_folder=<folder>`` to every ``from_pretrained`` call that passes a ``device_map`` (so with the
server's default ``--device auto``, accelerate places what fits in the budget on the CPU and the rest in the
folder), then runs transformers' own command line unchanged with the remaining arguments. ``--cold``: after each
forward of a module whose weights accelerate reads from disk, those weights' bytes leave the page cache
(``POSIX_FADV_DONTNEED``), so each pass reads them from the disk again, as ``page_cache=0`` does for offload_core::

    python bench/hf_serve_offloaded.py --max-memory-cpu 500MiB --offload-folder /tmp/off -- \\
        serve --continuous-batching --port 8001 /path/to/model
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import struct
import sys
from pathlib import Path


def tensor_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor of a safetensors file: its bytes ``[start, end)`` in the file."""
    with path.open("rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    return {
        k: (8 + size + v["data_offsets"][0], 8 + size + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    }


def module_ranges(module, folder: str) -> list[tuple[Path, int, int]]:
    """The file byte ranges accelerate reads ``module``'s offloaded weights from: a ``.dat`` file of the offload
    folder whole, or a tensor's bytes in the checkpoint's safetensors file its index points at."""
    weights = getattr(module._hf_hook, "weights_map", None)
    index = getattr(getattr(weights, "dataset", None), "index", None) or {}
    prefix = getattr(weights, "prefix", "")
    ranges = []
    for name, _ in module.named_parameters(recurse=False):
        entry = index.get(prefix + name)
        if entry is None:
            continue
        if "safetensors_file" in entry:
            path = Path(entry["safetensors_file"]).resolve()
            ranges.append((path, *tensor_ranges(path)[entry.get("weight_name", prefix + name)]))
        else:
            path = Path(folder) / f"{prefix + name}.dat"
            ranges.append((path, 0, path.stat().st_size))
    return ranges


def keep_cold(model, folder: str) -> int:
    """After each forward of a module whose weights accelerate reads from disk, drop those weights' bytes from the
    page cache (as ``page_cache=0`` drops each block's after it runs); the number of such modules."""

    def dropper(ranges):
        def drop(*_):
            for path, start, end in ranges:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

        return drop

    hooked = 0
    for module in model.modules():
        if getattr(getattr(module, "_hf_hook", None), "offload", False):
            ranges = module_ranges(module, folder)
            if ranges:
                module.register_forward_hook(dropper(ranges))
                dropper(ranges)()
                hooked += 1
    print(
        f"hf_serve_offloaded: cold, the weights of {hooked} modules dropped from the page cache after their forward",
        file=sys.stderr,
        flush=True,
    )
    return hooked


def offload_every_load(budget: str, folder: str, cold: bool = False) -> None:
    """Make ``PreTrainedModel.from_pretrained`` pass the budget and the offload folder with any device map (and with
    ``cold``, keep the offloaded weights out of the page cache)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        if kwargs.get("device_map") is not None:
            kwargs = {**kwargs, "max_memory": {"cpu": budget}, "offload_folder": folder}
        model = original(cls, *args, **kwargs)
        placed = getattr(model, "hf_device_map", None)
        if placed:  # said once, so a report can state where the peer's weights lived
            kinds = sorted(set(map(str, placed.values())))
            hooked = [m for m in model.modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)]
            on_disk = sum(end - start for m in hooked for _, start, end in module_ranges(m, folder))
            print(
                f"hf_serve_offloaded: {cls.__name__} device map over {kinds}, {on_disk / 2**20:.1f} MiB of weights "
                "read from disk",
                file=sys.stderr,
                flush=True,
            )
            if cold:
                keep_cold(model, folder)
        return model

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--max-memory-cpu", required=True, help="accelerate size string, e.g. 500MiB")
    parser.add_argument("--offload-folder", required=True)
    parser.add_argument("--cold", action="store_true", help="offloaded weights read from disk every pass")
    parser.add_argument("cli", nargs=argparse.REMAINDER, help="-- then transformers' command line, e.g. serve ...")
    args = parser.parse_args()
    offload_every_load(args.max_memory_cpu, args.offload_folder, args.cold)
    from transformers.cli.transformers import app

    cli = args.cli[1:] if args.cli[:1] == ["--"] else args.cli
    app(args=cli, prog_name="transformers")


if __name__ == "__main__":
    main()
