"""Measure the lossless bf16 code of ``storage.codec=exponent``: the fraction of their bytes real and synthetic weights
take packed, and how fast a device decodes them against the bound it replaces (raw host-to-device copies).

For each checkpoint (synthetic presets, and SmolLM2-135M where its package is installed) every bf16 tensor, up to
``--ratio-bytes`` of them, is packed and checked bit for bit. On ``--device`` a tensor of ``--elements`` bf16 weights
is then copied raw from pinned memory, copied packed and decoded (as ``hook=prefetch`` does), and decoded from device
memory alone; each medians of ``--reps``, outputs checked bit for bit. The per-token ratio it predicts for a dense
model (packed copy, then decoding on the same stream, against the raw copy) is what
``bench/compare.py --systems ours:prefetch:pinned_cpu,ours:prefetch:pinned_cpu+codec=exponent`` measures.

    python bench/gpu_codec.py --device cpu --preset tiny
    python bench/gpu_codec.py --device cuda --preset 3.4b --elements 67108864
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from offload_core.loading import sources  # noqa: E402
from offload_core.loading.checkpoint import Checkpoint  # noqa: E402
from offload_core.storage import codec  # noqa: E402


def ratio_of(path: Path, limit: int, chunk: int) -> dict:
    """Pack the checkpoint's tensors (in bf16) until ``limit`` raw bytes; each decoded back and compared."""
    checkpoint = Checkpoint.open(path)
    raw = packed = tensors = kept_raw = 0
    started = time.perf_counter()
    for key in checkpoint.keys():
        if raw >= limit:
            break
        if not checkpoint.dtype(key).is_floating_point:
            continue
        tensor = checkpoint.get(key).to(torch.bfloat16)
        nbytes = tensor.numel() * 2
        code = codec.encode(tensor, chunk)
        if code is not None:
            assert torch.equal(codec.decode(code).view(torch.int16), tensor.view(torch.int16)), key
        raw += nbytes
        packed += code.nbytes if code is not None else nbytes
        tensors += 1
        kept_raw += code is None
    seconds = time.perf_counter() - started
    return {
        "checkpoint": str(path),
        "tensors": tensors,
        "kept_raw": kept_raw,
        "raw_bytes": raw,
        "packed_bytes": packed,
        "ratio": packed / raw if raw else None,
        "encode_and_check_bytes_per_s": raw / seconds if seconds else None,
    }


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` (the device synchronized around each)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def decode_rates(device: torch.device, elements: int, chunk: int, reps: int) -> dict:
    pin = device.type == "cuda"
    weights = (torch.randn(elements, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    host = weights.pin_memory() if pin else weights
    packed = codec.encode(weights, chunk, lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pin))
    out = torch.empty(elements, dtype=torch.bfloat16, device=device)
    scratch = codec.Scratch(device, chunk)
    blob = codec.Views(packed.blob.to(device))

    def check() -> None:
        assert torch.equal(out.cpu().view(torch.int16), weights.view(torch.int16)), "decoded bytes differ"
        out.fill_(float("nan"))

    def decode_on_device() -> None:  # the packed bytes already there: the decoding kernels alone
        pairs = out.view(torch.uint8).view(-1, 2)
        for c in packed.chunks:
            codec.decode_chunk(blob, c.offset, c, scratch.indices, scratch.high, pairs[c.start : c.start + c.count])

    raw_s = timed(lambda: out.copy_(host, non_blocking=pin), device, reps)
    check()
    packed_s = timed(lambda: codec.decode_into(packed, out, scratch), device, reps)
    check()
    decode_s = timed(decode_on_device, device, reps)
    check()
    nbytes = elements * 2
    return {
        "elements": elements,
        "chunk": chunk,
        "ratio": packed.nbytes / nbytes,
        "raw_copy_s": raw_s,
        "raw_copy_bytes_per_s": nbytes / raw_s,
        "packed_copy_and_decode_s": packed_s,
        "packed_copy_and_decode_bytes_per_s": nbytes / packed_s,
        "decode_only_s": decode_s,
        "decode_only_bytes_per_s": nbytes / decode_s,
        "packed_over_raw_time": packed_s / raw_s,
        "scratch_bytes": scratch.nbytes,
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with open("/proc/cpuinfo") as info:
        names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
    return names[0] if names else platform.machine()


def report(result: dict) -> str:
    d = result["decode"]
    gb = 1e9
    lines = [
        f"# Lossless bf16 code (`storage.codec=exponent`) on {result['device_name']} ({result['device']})",
        "",
        f"`{result['command']}` · torch {result['torch']} · {result['date']}",
        "",
        "| weights | tensors (kept raw) | raw | packed | ratio |",
        "|---|---|---|---|---|",
    ]
    for name, r in result["ratios"].items():
        if "error" in r:
            lines.append(f"| {name} | not measured: {r['error']} | | | |")
            continue
        lines.append(
            f"| {name} | {r['tensors']} ({r['kept_raw']}) | {r['raw_bytes'] / gb:.3f} GB | "
            f"{r['packed_bytes'] / gb:.3f} GB | {r['ratio']:.4f} |"
        )
    lines += [
        "",
        f"{d['elements']} bf16 weights ({d['elements'] * 2 / gb:.3f} GB), chunks of {d['chunk']} elements, "
        f"scratch {d['scratch_bytes'] / 2**20:.1f} MiB, medians of {result['reps']}, outputs checked bit for bit:",
        "",
        "| step | time | rate (decoded bytes) |",
        "|---|---|---|",
        f"| raw copy from pinned host memory (the bound without the code) | {d['raw_copy_s'] * 1e3:.2f} ms | "
        f"{d['raw_copy_bytes_per_s'] / gb:.2f} GB/s |",
        f"| packed copy + decoding (what `hook=prefetch` queues) | {d['packed_copy_and_decode_s'] * 1e3:.2f} ms | "
        f"{d['packed_copy_and_decode_bytes_per_s'] / gb:.2f} GB/s |",
        f"| decoding alone (packed bytes already on the device) | {d['decode_only_s'] * 1e3:.2f} ms | "
        f"{d['decode_only_bytes_per_s'] / gb:.2f} GB/s |",
        "",
        *(
            ["On a CPU the copies are host to host: these figures check the script, they are not a GPU's.", ""]
            if result["device"] == "cpu"
            else []
        ),
        f"Packed copy + decoding takes **{d['packed_over_raw_time']:.3f}x** the raw copy's time "
        f"(packed bytes {d['ratio']:.4f} of the raw ones): the transfer bound per token of a dense model streamed "
        "this way, relative to the uncompressed one.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="where to decode: cpu or cuda (default cpu)")
    parser.add_argument("--preset", default="tiny", help="synthetic presets whose weights to pack, comma-separated")
    parser.add_argument("--no-smollm2", action="store_true", help="skip SmolLM2-135M's weights")
    parser.add_argument("--ratio-bytes", type=float, default=1e9, help="pack at most this many bytes per checkpoint")
    parser.add_argument("--elements", type=int, default=None, help="weights decoded (default 64Mi cuda, 4Mi cpu)")
    parser.add_argument("--chunk", type=int, default=codec.CHUNK_ELEMENTS, help="elements per chunk")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results"), help="folder of the .json and .md reports")
    parser.add_argument("--tag", help="report name suffix (default: the device and presets)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_codec: --device cuda but torch sees no CUDA device")
    presets = [p for p in args.preset.split(",") if p]
    ratios = {}
    for preset in presets:
        path = sources.synthetic_checkpoint(**sources.synthetic_preset(preset))
        ratios[f"synthetic {preset}"] = ratio_of(path, int(args.ratio_bytes), args.chunk)
    if not args.no_smollm2:
        try:
            ratios["SmolLM2-135M (bf16)"] = ratio_of(sources.smollm2_checkpoint(), int(args.ratio_bytes), args.chunk)
        except Exception as error:  # the package is not installed everywhere
            ratios["SmolLM2-135M (bf16)"] = {"error": " ".join(str(error).split())[:200]}
    elements = args.elements or (2**26 if device.type == "cuda" else 2**22)
    result = {
        "command": shlex.join(["python", "bench/gpu_codec.py", *sys.argv[1:]]),
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "reps": args.reps,
        "ratios": ratios,
        "decode": decode_rates(device, elements, args.chunk, args.reps),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or f"{device.type}-{'-'.join(presets)}"
    (out / f"gpu-codec-{tag}.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (out / f"gpu-codec-{tag}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
