"""MoE offload benchmark: builds a synthetic Mixtral-like checkpoint (bf16, per-expert tensors as transformers saves them),
runs ``bench/compare.py`` on it (fresh processes, alternated, warm and cold page cache) and reports the expert figures.

    python bench/moe.py --preset mixtral-2.6g --tokens 6 --reps 1            # build, run warm and cold, report
    python bench/moe.py --preset mixtral-2.6g --report-only                   # redo moe-*.md/.png from the .json

Writes ``bench/results/compare-moe-<preset>[-cold].json|md|png`` (compare.py's own) and
``bench/results/moe-<preset>.md|png``: bytes read per decode token against the ideal, decode tok/s, peak
anonymous RSS, expert cache hit rate and guess accuracy, and the issue's targets met or not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("OFFLOAD_CORE_CACHE", Path.home() / ".cache" / "offload_core"))

#: preset -> Mixtral config fields (bf16): about 2.6 GB, 8 experts, top-2
PRESETS = {
    "mixtral-2.6g": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2),
    "mixtral-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, num_local_experts=8, num_experts_per_tok=2),
}
BLOCK = "ours:prefetch:safetensors"
SYSTEMS = ["inmem", "accelerate", BLOCK, "ours:experts+cache_slots=0+guess=none:safetensors",
           "ours:experts+guess=none:safetensors", "ours:experts+guess=previous:safetensors", "ours:experts:safetensors"]


def build(preset: str) -> Path:
    """The preset's checkpoint folder, built once (seeded random weights, saved by ``save_pretrained``)."""
    import torch
    import transformers

    path = CACHE / f"moe-{preset}"
    if (path / "config.json").exists():
        return path
    config = transformers.MixtralConfig(**PRESETS[preset], max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02 if param.dim() < 3 else 0.05)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(path.with_suffix(".tmp"), max_shard_size="1GB")
    path.with_suffix(".tmp").rename(path)
    return path


def layer_split(config: dict) -> tuple[int, int]:
    """Bytes of one decoder layer that are experts, and that are not (bf16)."""
    h, i, e = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    experts = e * 3 * h * i * 2
    other = (2 * h * h + 2 * h * kv + e * h + 2 * h) * 2
    return experts, other


def run(args, path: Path, cold: bool) -> Path:
    tag = f"moe-{args.preset}" + ("-cold" if cold else "")
    command = [sys.executable, str(HERE / "compare.py"), "--checkpoint", str(path), "--budget", str(args.budget),
               "--tokens", str(args.tokens), "--reps", str(args.reps), "--systems", ",".join(args.systems),
               "--tag", tag, "--code", "worktree", "--timeout", str(args.timeout)]
    if cold:
        command.append("--cold")
    subprocess.run(command, check=True)
    return HERE / "results" / f"compare-{tag}.json"


def report(preset: str, files: list[Path]) -> None:
    config = PRESETS[preset]
    experts, other = layer_split(config)
    routed = experts * config["num_experts_per_tok"] // config["num_local_experts"]
    lines = [f"# MoE offload, {preset} (8 experts, top-2, bf16)", "",
             "Ideal bytes per decode token = for each offloaded decoder layer, its non-expert bytes plus its routed "
             "experts' bytes (offloaded layers counted from the offloaded bytes; embeddings and head assumed resident).", ""]
    rows_for_plot = []
    targets = []
    for file in files:
        if not file.exists():
            continue
        data = json.loads(file.read_text())
        medians = data["medians"]
        cold = "cold" in file.name
        lines += [f"## {'cold' if cold else 'warm'} page cache ({file.name})", "",
                  "| system | decode tok/s | bytes read/token | ideal | ratio | peak anon RSS | hit rate | guess accuracy | same tokens |",
                  "|---|---|---|---|---|---|---|---|---|"]
        runs = [r for r in data["runs"] if "error" not in r]
        for system, row in medians.items():
            offloaded = row.get("offloaded_bytes") or 0
            layers = offloaded / (experts + other)
            ideal = layers * (other + routed)
            mine = [r for r in runs if r.get("system") == system]
            hit = _median([r.get("experts_expert_hit_rate") for r in mine])
            guess = _median([r.get("experts_expert_guess_accuracy") for r in mine])
            per_token = _median([r.get("experts_expert_bytes_per_token") for r in mine])
            read = row.get("bytes_read_per_token")
            if per_token is not None and read is not None:
                read = per_token + _median([r.get("bytes_read_per_token", 0) - r.get("experts_expert_bytes", 0) / max(r.get("generated_tokens", 1), 1)
                                            for r in mine])
            ratio = read / ideal if read and ideal else None
            lines.append(f"| {system} | {_f(row.get('decode_tokens_per_s'))} | {_gb(read)} | {_gb(ideal)} | {_f(ratio)} | "
                         f"{_gb(row.get('peak_anon_rss_bytes'))} | {_f(hit)} | {_f(guess)} | {row.get('matches_in_memory')} |")
            rows_for_plot.append((("cold " if cold else "warm ") + system, row.get("decode_tokens_per_s") or 0, read or 0))
            if system.startswith("ours:experts") and ratio is not None:
                targets.append(f"- bytes/token ≤ 1.2 × ideal ({'cold' if cold else 'warm'}, {system}): {ratio:.2f} × — "
                               f"{'met' if ratio <= 1.2 else 'not met'}")
        best = max((row.get("decode_tokens_per_s") or 0 for s, row in medians.items() if s.startswith("ours:experts")), default=0)
        block = medians.get(BLOCK, {}).get("decode_tokens_per_s")
        acc = medians.get("accelerate", {}).get("decode_tokens_per_s")
        if block:
            bound = 2.5 if cold else 0.97
            targets.append(f"- {'cold' if cold else 'warm'}: best expert-granular {best:.3f} tok/s vs block-granular {block:.3f} = "
                           f"{best / block:.2f} × (target ≥ {bound}) — {'met' if best / block >= bound else 'not met'}")
        if cold and acc:
            targets.append(f"- cold: vs accelerate {acc:.3f} tok/s = {best / acc:.2f} × (target ≥ 5) — {'met' if best / acc >= 5 else 'not met'}")
        lines.append("")
    lines += ["## Targets", "", *targets, ""]
    out = HERE / "results" / f"moe-{preset}.md"
    out.write_text("\n".join(lines))
    _plot(rows_for_plot, out.with_suffix(".png"))
    print(out.read_text())


def _plot(rows: list[tuple[str, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 0.45 * len(rows) + 1.5))
    names = [r[0] for r in rows]
    left.barh(names, [r[1] for r in rows])
    left.set_xlabel("decode tokens/s")
    right.barh(names, [r[2] / 2**20 for r in rows])
    right.set_xlabel("MiB read per decode token")
    right.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _median(values: list) -> float | None:
    values = sorted(v for v in values if isinstance(v, (int, float)))
    return values[len(values) // 2] if values else None


def _f(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _gb(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mixtral-2.6g", choices=sorted(PRESETS))
    parser.add_argument("--budget", help="max_memory.cpu (default: a quarter of the model)")
    parser.add_argument("--tokens", type=int, default=6)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--systems", type=lambda s: s.split(","), default=SYSTEMS)
    parser.add_argument("--warm-only", action="store_true")
    parser.add_argument("--cold-only", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    files = [HERE / "results" / f"compare-moe-{args.preset}{suffix}.json" for suffix in ("", "-cold")]
    if not args.report_only:
        path = build(args.preset)
        if args.budget is None:
            total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            args.budget = str(total // 4)
        if not args.cold_only:
            run(args, path, cold=False)
        if not args.warm_only:
            run(args, path, cold=True)
    report(args.preset, files)


if __name__ == "__main__":
    main()
