"""Quantized checkpoints offloaded packed: a synthetic Llama quantized by transformers with torchao (int8 and int4
weight-only) and bitsandbytes (nf4) at a cpu budget of half its packed bytes, ours against transformers/accelerate's
``device_map`` offloading of the same checkpoint, and both on the bfloat16 model it was quantized from at that budget.

Each system runs in a fresh process (``--child``): decode tokens/s, bytes moved per token, whether the tokens are the
in-memory quantized model's, or the error it ended in. Writes ``quantized-peers.{json,md}`` under ``--out``
(``--device cuda``: the budget is GPU 0's, ours streams from pinned host memory with ``hook=prefetch``, and the
report is ``quantized-peers-cuda``)::

    python bench/quantized_peers.py --out bench/results --scratch /tmp/quantized-bench
    python bench/quantized_peers.py --device cuda --tokens 32 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 450, 4996, 11354, 1701, 432, 7204, 975, 278, 13366, 11203, 9889, 13, 3492, 526, 263]
#: the synthetic model: 8 Llama blocks of 12.8M parameters, a 16k vocabulary (272 MB in bfloat16)
SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=16384,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
METHODS = ["torchao-int8", "torchao-int4", "bnb-nf4"]


def _quant_config(method: str):
    import torch
    import transformers

    if method == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig

        return transformers.TorchAoConfig(Int8WeightOnlyConfig())
    if method == "torchao-int4":  # torchao's int4 weight-only layout that runs on the CPU (codes held in int8)
        from torchao.quantization import IntxWeightOnlyConfig, PerGroup

        return transformers.TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )


def build(scratch: Path) -> dict[str, Path]:
    """The bfloat16 synthetic model and its quantized checkpoints under ``scratch`` (made once)."""
    import torch
    import transformers

    folders = {"bf16": scratch / "bf16", **{m: scratch / m for m in METHODS}}
    if not (folders["bf16"] / "config.json").exists():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).to(torch.bfloat16)
        model.save_pretrained(folders["bf16"])
    for method in METHODS:
        if not (folders[method] / "config.json").exists():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                folders["bf16"], quantization_config=_quant_config(method), dtype=torch.bfloat16
            )
            model.save_pretrained(folders[method])
    return folders


def packed_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _generate(model, tokens: int, device: str) -> tuple[list[int], float, float, float]:
    """Greedy tokens, and the seconds of a first call (one token: one-time work included), of a second one and of a
    call of ``tokens`` tokens: the decoding rate is the difference of the last two."""
    import torch

    ids = torch.tensor([PROMPT], device=device)
    times = []
    with torch.inference_mode():
        for count in (1, 1, tokens):
            started = time.perf_counter()
            out = model.generate(ids, max_new_tokens=count, do_sample=False)
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    return out[0, len(PROMPT) :].tolist(), *times


def child(spec: dict) -> dict:
    """One system on one checkpoint: its figures, or the error it ended in."""
    import torch
    import transformers

    torch.manual_seed(0)
    folder, budget, system, tokens = Path(spec["folder"]), spec["budget"], spec["system"], spec["tokens"]
    device = spec.get("device", "cpu")
    result: dict = {"system": system, "model": folder.name, "budget": budget}
    # a CPU run: the budget is the cpu's and the rest goes to disk; a GPU run: the budget is GPU 0's, the rest in RAM
    max_memory = {"cpu": budget} if device == "cpu" else {0: budget, "cpu": 64 * 2**30}
    offloaded = ("disk",) if device == "cpu" else ("cpu", "disk")
    try:
        started = time.perf_counter()
        if system == "ours":
            import offload_core

            options = {} if device == "cpu" else {"storage": "pinned_cpu", "policy": "prefetch"}
            model = offload_core.from_pretrained(folder, max_memory, options)
            places = model.offload_plan.summary["devices"]
            result["planned_offloaded_bytes"] = sum(places.get(d, {}).get("bytes", 0) for d in offloaded)
        elif system == "in-memory":
            model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, **({} if device == "cpu" else {"device_map": {"": 0}})
            )
        else:  # transformers' device_map offloading (accelerate's hooks), an offload folder on disk
            model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, device_map="auto", max_memory=max_memory, offload_folder=spec["scratch"] + "/offload"
            )
            on_disk = [m for m, d in model.hf_device_map.items() if d in offloaded]
            result["offloaded_modules"] = len(on_disk)
            result["bytes_moved_per_token"] = sum(
                p.numel() * p.element_size()
                for m in on_disk
                for p in model.get_submodule(m).state_dict().values()  # the offload folder's tensors, as moved
            )
        result["load_s"] = time.perf_counter() - started
        if system == "ours":
            model.offload_state.stats.reset()
        ids, cold, first, total = _generate(model, tokens, "cpu" if device == "cpu" else "cuda:0")
        result.update(tokens=ids, cold_first_token_s=cold, first_token_s=first)
        result["decode_tok_s"] = (tokens - 1) / max(total - first, 1e-9)
        if system == "ours":  # forwards: one per generated token
            result["bytes_moved_per_token"] = model.offload_state.stats.snapshot()["bytes"] // (tokens + 2)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run this case is a result
        result["error"] = _short(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return result


def _short(error: str) -> str:
    """An error's message up to its pointer to a web page."""
    return error.split(" Check http")[0][:400]


def run(spec: dict, timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {**spec, "error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1])


def report(data: dict) -> str:
    rows = [
        "| model | system | budget | decode tok/s | first token s (first call) | bytes moved / token "
        "| same tokens as in memory | outcome |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        same = r.get("same_tokens", "")
        moved = f"{r['bytes_moved_per_token'] / 1e6:.1f} MB" if "bytes_moved_per_token" in r else ""
        rate = f"{r['decode_tok_s']:.2f}" if "decode_tok_s" in r else ""
        first = f"{r['first_token_s']:.2f} ({r['cold_first_token_s']:.2f})" if "first_token_s" in r else ""
        rows.append(
            f"| {r['model']} | {r['system']} | {r['budget'] / 1e6:.0f} MB | {rate} | {first} | {moved} | {same} | "
            f"{r.get('error', 'ran')} |"
        )
    sizes = ", ".join(f"{name} {size / 1e6:.0f} MB" for name, size in data["packed_bytes"].items())
    return "\n".join(
        [
            "# Quantized checkpoints offloaded packed, against transformers/accelerate offloading",
            "",
            f"Command: `{data['command']}`. Machine: {data['machine']}; load average {data['load_before']} before, "
            f"{data['load_after']} after (2 cores, shared: figures are noisy). Checkpoints (safetensors): {sizes}. "
            f"Each {'cpu' if data.get('device', 'cpu') == 'cpu' else 'GPU 0'} budget is half the packed "
            "checkpoint's bytes (the bfloat16 rows use the int8 budget). The "
            "page cache is warm (each system reads files another run just read). Each process generates one token "
            "twice, then the tokens: the first call pays one-time work (bitsandbytes' CPU layout of 4-bit weights, "
            "made at a layer's first forward and kept in memory; ours makes it at every forward of an offloaded "
            "layer), the decoding rate is the last two calls' difference. `bytes moved / token`: ours as "
            "counted by its module hooks; accelerate's the bytes of the modules its map puts on disk, moved once "
            "per forward. Same tokens: against transformers' in-memory model of the same checkpoint.",
            "",
            *rows,
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/offload-core-quantized-bench"))
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the budget is GPU 0's")
    parser.add_argument("--child")
    parser.add_argument("--report", type=Path, help="write the .md of a .json this script wrote, and stop")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    if args.report:
        data = json.loads(args.report.read_text())
        for result in data["results"]:
            if "error" in result:
                result["error"] = _short(result["error"])
        args.report.write_text(json.dumps(data, indent=1))
        args.report.with_suffix(".md").write_text(report(data))
        return
    args.scratch.mkdir(parents=True, exist_ok=True)
    folders = build(args.scratch)
    load_before = [round(x, 1) for x in os.getloadavg()]
    results = []
    for method in [*METHODS, "bf16"]:
        budget = packed_bytes(folders[method if method != "bf16" else "torchao-int8"]) // 2
        reference = None
        systems = ["ours", "accelerate"] if method == "bf16" else ["in-memory", "ours", "accelerate"]
        for system in systems:
            spec = dict(folder=str(folders[method]), budget=budget, system=system, tokens=args.tokens)
            spec["device"] = args.device
            result = run({**spec, "scratch": str(args.scratch)}, args.timeout)
            if system == "in-memory":
                reference = result.get("tokens")
            elif reference is not None and "tokens" in result:
                result["same_tokens"] = result["tokens"] == reference
            print(json.dumps({k: v for k, v in result.items() if k != "tokens"}), flush=True)
            results.append(result)
    data = {
        "command": "python bench/quantized_peers.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} cpus, torch {__import__('torch').__version__}",
        "device": args.device,
        "load_before": load_before,
        "load_after": [round(x, 1) for x in os.getloadavg()],
        "packed_bytes": {name: packed_bytes(folder) for name, folder in folders.items()},
        "results": results,
    }
    if args.device == "cuda":
        data["machine"] += f", {__import__('torch').cuda.get_device_name(0)}"
    args.out.mkdir(parents=True, exist_ok=True)
    name = "quantized-peers" if args.device == "cpu" else "quantized-peers-cuda"
    (args.out / f"{name}.json").write_text(json.dumps(data, indent=1))
    (args.out / f"{name}.md").write_text(report(data))
    print(f"wrote {args.out / name}.md")


if __name__ == "__main__":
    main()
