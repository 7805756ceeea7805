"""GGUF dequantization speed: output GB/s (float32 bytes written per second) of offload_core's torch kernels, one torch
thread, into a preallocated buffer, against gguf-py's numpy ``dequantize`` on the same blocks; on a GPU too where one is
present (the same kernels as device-side torch ops). Figures written to bench/results/dequant[-<tag>].{json,md}.

    python bench/dequant.py                       # every fast type, 16M elements each
    python bench/dequant.py --elements 4000000 --types Q4_1 Q8_0 --tag quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from offload_core.storage.gguf.dequant import dequantize_into  # noqa: E402
from tests.gguf_files import _SCALES, _random_blocks  # noqa: E402

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"]


def blocks(kind: T, elements: int, rng: np.random.Generator) -> np.ndarray:
    """``elements`` values of ``kind`` as raw blocks: gguf-py's quantizer where it has one, else random valid blocks."""
    if int(kind) in _SCALES:
        return _random_blocks(int(kind), (elements // 1024, 1024), rng)
    data = rng.standard_normal((elements // 1024, 1024)).astype(np.float32)
    return quantize(data, kind).view(np.uint8) if kind in (T.F16, T.F32) else quantize(data, kind)


def best_of(repeats: int, call) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(kind: T, elements: int, repeats: int, rng: np.random.Generator) -> dict:
    raw = blocks(kind, elements, rng)
    out = torch.empty(raw.shape[0] * 1024, dtype=torch.float32)
    source = torch.from_numpy(np.ascontiguousarray(raw))
    dequantize_into(source, int(kind), out)
    exact = np.array_equal(out.numpy().view(np.int32), dequantize(raw, kind).reshape(-1).view(np.int32))
    gb = out.numel() * 4 / 1e9
    ours = best_of(repeats, lambda: dequantize_into(source, int(kind), out))
    theirs = best_of(max(repeats // 2, 1), lambda: dequantize(raw, kind))
    row = {
        "type": kind.name,
        "elements": out.numel(),
        "input_bytes": raw.nbytes,
        "bit_identical": bool(exact),
        "torch_cpu_1thread_gbps": gb / ours,
        "gguf_py_numpy_gbps": gb / theirs,
        "speedup_vs_gguf_py": theirs / ours,
    }
    if torch.cuda.is_available():
        device_raw, device_out = source.cuda(), out.cuda()
        dequantize_into(device_raw, int(kind), device_out)
        torch.cuda.synchronize()
        row["gpu_bit_identical"] = bool(torch.equal(device_out.cpu().view(torch.int32), out.view(torch.int32)))

        def on_gpu():
            dequantize_into(device_raw, int(kind), device_out)
            torch.cuda.synchronize()

        row["torch_gpu_gbps"] = gb / best_of(repeats, on_gpu)
    return row


def copy_gbps(elements: int, repeats: int) -> float:
    """Float32 GB/s of a plain copy of ``elements`` (what one core's memory traffic allows a pass that reads and
    writes them): the yardstick of the kernels' output rate."""
    source, out = torch.randn(elements), torch.empty(elements)
    out.copy_(source)
    return elements * 4 / 1e9 / best_of(repeats, lambda: out.copy_(source))


def report(rows: list[dict], args: argparse.Namespace, machine: dict) -> str:
    lines = [
        f"# GGUF dequantization, output GB/s ({args.elements:,} elements per type, best of {args.repeats})",
        "",
        f"{platform.processor() or platform.machine()}, torch {machine['torch']}, "
        "one torch thread "
        f"({'with ' + machine['gpu'] if machine.get('gpu') else 'no GPU'}); "
        "gguf-py's numpy dequantize on the same blocks. `python bench/dequant.py` reproduces it. "
        f"Load average over 1/5/15 min {'/'.join(f'{v:.1f}' for v in machine['load_average'])} on "
        f"{machine['cpus']} CPUs (absolute rates fall with the load; the ratios are of one run). "
        f"A float32 copy of as many elements ran at {machine['copy_gbps']:.2f} GB/s "
        '(the "share of a float32 copy" column is each type\'s rate over it).',
        "",
        "| type | torch CPU, 1 thread | gguf-py numpy | speed-up | bit-identical | share of a float32 copy |"
        + (" GPU | GPU bit-identical |" if machine.get("gpu") else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if machine.get("gpu") else ""),
    ]
    for row in rows:
        gpu = f" {row['torch_gpu_gbps']:.1f} | {row['gpu_bit_identical']} |" if "torch_gpu_gbps" in row else ""
        lines.append(
            f"| {row['type']} | {row['torch_cpu_1thread_gbps']:.2f} | {row['gguf_py_numpy_gbps']:.2f} | "
            f"{row['speedup_vs_gguf_py']:.2f}x | {row['bit_identical']} | "
            f"{row['torch_cpu_1thread_gbps'] / machine['copy_gbps']:.2f} |{gpu}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--elements", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--types", nargs="+", default=TYPES)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)  # per core
    rng = np.random.default_rng(0)
    rows = [measure(T[name], args.elements, args.repeats, rng) for name in args.types]
    machine = {
        "copy_gbps": copy_gbps(args.elements, args.repeats),
        "load_average": list(os.getloadavg()),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    name = "dequant" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"elements": args.elements, "rows": rows, **machine}
    (args.out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    text = report(rows, args, machine)
    (args.out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
