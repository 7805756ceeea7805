"""A Mixtral-like checkpoint larger than this machine's RAM, written one shard at a time with the names
transformers saves (one tensor per expert: ``block_sparse_moe.experts.<e>.w1/w2/w3``), and its benchmark run.

    OFFLOAD_CORE_CACHE=/tmp/bigcache flock /tmp/bench.lock python bench/moe_large.py --tokens 3

Runs block-granular prefetch and the expert-granular policy (cache and router guess) on the checkpoint's own
shards (`storage=safetensors`), `max_memory.cpu` a quarter of the model, offloaded files dropped before the
first run of each system; measures the disk's mapped-read bandwidth in the same run and writes
`bench/results/moe-large.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from moe import routed_bytes_needed  # noqa: E402

CACHE = Path(os.environ.get("OFFLOAD_CORE_CACHE", Path.home() / ".cache" / "offload_core"))

#: about 31 GB in bf16: 38 layers of 8 experts (top-2) of 2048 x 8192
CONFIG = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=38,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    num_local_experts=8,
    num_experts_per_tok=2,
)
NAME = "moe-mixtral-31g"


def saved_entries(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of the checkpoint, in order, named and shaped as transformers saves a Mixtral model."""
    h, f, e = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    head = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    entries = [("model.embed_tokens.weight", (config["vocab_size"], h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        entries += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "block_sparse_moe.gate.weight", (e, h)),
        ]
        for x in range(e):
            q = f"{p}block_sparse_moe.experts.{x}."
            entries += [(q + "w1.weight", (f, h)), (q + "w2.weight", (h, f)), (q + "w3.weight", (f, h))]
    entries += [("model.norm.weight", (h,)), ("lm_head.weight", (config["vocab_size"], h))]
    return entries


def build() -> Path:
    """The checkpoint folder under the cache, built once, shard by shard (never whole in memory)."""
    import torch
    import transformers

    from offload_core.loading.writer import plan_shards, write_safetensors_shards

    path = CACHE / NAME
    if (path / "config.json").exists():
        return path
    entries = dict(saved_entries(CONFIG))
    shards = plan_shards([(n, 2 * math.prod(s)) for n, s in entries.items()], 2 * 10**9)

    def produce(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(entries[name], dtype=torch.bfloat16)
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return torch.randn(entries[name], generator=generator).mul_(0.05 if ".experts." in name else 0.02).bfloat16()

    tmp = path.with_suffix(".tmp")
    write_safetensors_shards(tmp, shards, produce)
    config = transformers.MixtralConfig(**CONFIG, max_position_embeddings=4096, tie_word_embeddings=False)
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp)
    tmp.rename(path)
    return path


SYSTEMS = "ours:prefetch:safetensors,ours:experts+cache_slots=1:safetensors"


def report(data: dict, out: Path) -> None:
    """The figures and the issue's larger-than-RAM targets, from compare.py's results."""
    h, f, e, k = (CONFIG[x] for x in ("hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok"))
    entries = saved_entries(CONFIG)
    expert = 3 * h * f * 2
    layer = sum(2 * math.prod(s) for n, s in entries if n.startswith("model.layers.0."))
    medians, runs = data["medians"], [r for r in data["runs"] if "error" not in r]
    tokens = {r["system"]: r.get("token_ids") for r in runs}
    lines = [
        f"# MoE larger than RAM: {NAME} ({data['checkpoint_bytes'] / 1e9:.1f} GB bf16, {e} experts, top-{k})",
        "",
        f"Reproduce: `{data['command']}` (via `python bench/moe_large.py`)",
        "",
        f"Machine: {data['machine']}; load average {data['loadavg_start']} at the start, "
        f"{data['loadavg_end']} at the end.",
        "",
        "| system | s/decode token | GB read from disk/token | needed GB/token | bound s (1.25 × that ÷ bw) "
        "| within | peak anon RSS GB | budget GB | same tokens as block-granular |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    block = tokens.get("ours:prefetch:safetensors")
    for system, row in medians.items():
        layers = (row.get("offloaded_bytes") or 0) / layer
        bandwidth = row.get("sequential_read_bytes_per_s") or 0
        mine = [r for r in runs if r["system"] == system]
        cached = sum(r.get("experts_expert_hits", 0) for r in mine) / max(len(mine), 1)
        generated = max((r.get("generated_tokens") or 1 for r in mine), default=1)
        if system.startswith("ours:experts") and row.get("device_map"):  # the routed share of what is on disk
            needed = routed_bytes_needed(CONFIG, row["device_map"]) - cached / generated * expert
        elif system.startswith("ours:experts"):  # the routed experts not found in the cache, and the rest of each layer
            needed = layers * (layer - (e - k) * expert) - cached / generated * expert
        else:  # block-granular: every offloaded byte
            needed = row.get("offloaded_bytes") or 0
        bound = 1.25 * needed / bandwidth if bandwidth else None
        seconds = 1 / row["decode_tokens_per_s"] if row.get("decode_tokens_per_s") else None
        lines.append(
            f"| {system} | {_f(seconds)} | {_f((row.get('disk_read_bytes_per_token') or 0) / 1e9)} | "
            f"{_f(needed / 1e9)} | {_f(bound)} | {seconds is not None and bound is not None and seconds <= bound} | "
            f"{_f((row.get('peak_anon_rss_bytes') or 0) / 1e9)} | {_f(data['budget_bytes'] / 1e9)} | "
            f"{tokens.get(system) == block} |"
        )
    experts = next((row for system, row in medians.items() if system.startswith("ours:experts")), {})
    blockrow = medians.get("ours:prefetch:safetensors", {})
    if experts.get("decode_tokens_per_s") and blockrow.get("decode_tokens_per_s"):
        lines += [
            "",
            f"Expert-granular against block-granular: "
            f"{experts['decode_tokens_per_s'] / blockrow['decode_tokens_per_s']:.2f} × the decode speed.",
        ]
    lines += [
        "",
        "The bound counts, per decode token, the offloaded layers' non-expert bytes and their routed experts "
        "(top-k of each layer) less the experts served from the cache (block-granular: every offloaded byte), "
        "over the disk's sequential read bandwidth measured by the same run.",
    ]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


def _f(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--tokens", type=int, default=3)
    parser.add_argument("--systems", default=SYSTEMS)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    results = HERE / "results"
    if not args.report_only:
        path = build()
        budget = sum(p.stat().st_size for p in path.glob("*.safetensors")) // 4
        subprocess.run(
            [
                sys.executable,
                str(HERE / "compare.py"),
                "--checkpoint",
                str(path),
                "--budget",
                str(budget),
                "--tokens",
                str(args.tokens),
                "--reps",
                "1",
                "--systems",
                args.systems,
                "--tag",
                "moe-large-cold",
                "--code",
                "worktree",
                "--timeout",
                "1800",
                "--cold",
            ],
            check=True,
        )
    report(json.loads((results / "compare-moe-large-cold.json").read_text()), results / "moe-large.md")


if __name__ == "__main__":
    main()
