"""\
MoE offload benchmark: builds a synthetic Mixtral-like checkpoint (bf16, per-expert tensors as transformers saves them),
runs ``bench/compare.py`` on it (fresh processes, alternated, warm and cold page cache) and reports the expert figures.

    python bench/moe.py --preset mixtral-2.6g --tokens 6 --reps 1            # build, run warm and cold, report
    python bench/moe.py --preset mixtral-2.6g --report-only                   # redo moe-*.md/.png from the .json

Writes ``bench/results/compare-moe-<preset>[-cold].json|md|png`` (compare.py's own) and
``bench/results/moe-<preset>.md|png``: bytes read per decode token against the ideal, decode tok/s, peak
anonymous RSS, expert cache hit rate and guess accuracy, and whether the targets (``bench/targets.py``) are met.
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
    "mixtral-2.6g": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "mixtral-tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
}
#: every policy on both stores that read files, beside in memory and accelerate
SYSTEMS = [
    "inmem",
    "accelerate",
    *(
        f"ours:{policy}:{store}"
        for policy in ("experts", "experts+guess=none", "prefetch", "align_per_call", "chained", "functional_call")
        for store in ("safetensors", "memmap")
    ),
]


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
    command = [
        sys.executable,
        str(HERE / "compare.py"),
        "--checkpoint",
        str(path),
        "--budget",
        str(args.budget),
        "--tokens",
        str(args.tokens),
        "--reps",
        str(args.reps),
        "--systems",
        ",".join(args.systems),
        "--tag",
        tag,
        "--code",
        "worktree",
        "--timeout",
        str(args.timeout),
    ]
    if cold:
        command.append("--cold")
    subprocess.run(command, check=True)
    return HERE / "results" / f"compare-{tag}.json"


def ideal_bytes(config: dict, offloaded: float, device_map: dict | None = None) -> float:
    """Disk bytes one decode token needs: the offloaded non-expert bytes and the routed share (top-k of the experts)
    of the offloaded expert tensors. From the run's device map where it has one (each tensor on ``disk``); else
    whole decoder layers counted from the offloaded bytes, the rest non-expert."""
    if device_map:
        return routed_bytes_needed(config, device_map)
    experts, other = layer_split(config)
    layers = min(config["num_hidden_layers"], int(offloaded // (experts + other)))
    return offloaded - layers * experts * (1 - config["num_experts_per_tok"] / config["num_local_experts"])


def routed_bytes_needed(config: dict, device_map: dict) -> float:
    """Bytes a decode token reads of the tensors ``device_map`` puts on the disk: each whole, but an expert tensor's
    routed share (top-k of the experts)."""
    from offload_core.planning import device_of

    share = config["num_experts_per_tok"] / config["num_local_experts"]
    return sum(
        size * (share if ".experts." in name else 1.0)
        for name, size in _tensor_bytes(config).items()
        if device_of(device_map, name) == "disk"
    )


def _tensor_bytes(config: dict) -> dict[str, int]:
    """Bytes of every parameter of the preset's model in bf16, by name (built on the meta device)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**config, max_position_embeddings=4096, tie_word_embeddings=False)
        )
    return {name: p.numel() * 2 for name, p in model.named_parameters()}


def report(preset: str, files: list[Path]) -> None:
    """Issue 27's figures and targets: warm ≥ 1.5 x accelerate and ≥ 0.6 x in memory; cold ≥ 3 x accelerate,
    disk bytes per decode token ≤ 1.2 x the ideal, per-token time ≤ 1.25 x ideal bytes ÷ sequential bandwidth."""
    config = PRESETS[preset]
    lines = [
        f"# MoE offload, {preset} ({config['num_local_experts']} experts, top-{config['num_experts_per_tok']}, bf16)",
        "",
        "Ideal = disk bytes a decode token needs: offloaded non-expert bytes + the routed experts of offloaded "
        "layers. Disk = `/proc/self/io` read_bytes between the first and last token (decode only). "
        "Ratios are of medians measured side by side in one alternated run.",
        "",
    ]
    rows_for_plot, targets = [], []
    for file in files:
        if not file.exists():
            continue
        data = json.loads(file.read_text())
        medians, cold = data["medians"], "cold" in file.name
        regime = "cold" if cold else "warm"
        inmem = medians.get("inmem", {}).get("decode_tokens_per_s")
        acc = medians.get("accelerate", {}).get("decode_tokens_per_s")
        lines += [
            f"## {regime} page cache ({file.name})",
            "",
            f"Load average {data.get('loadavg_start', '?')} at start, {data.get('loadavg_end', '?')} at end.",
            "",
            "| system | decode tok/s | × in memory | × accelerate | disk/decode token | ideal | ratio | "
            "token s ÷ (ideal ÷ seq. bandwidth) | peak anon RSS | guess accuracy (guessing) | same tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        runs = [r for r in data["runs"] if "error" not in r]
        for system, row in medians.items():
            mine = [r for r in runs if r.get("system") == system]
            tps = row.get("decode_tokens_per_s")
            ideal = (
                ideal_bytes(config, row.get("offloaded_bytes") or 0, row.get("device_map")) if system != "inmem" else 0
            )
            disk = row.get("disk_read_bytes_per_decode_token")
            ratio = disk / ideal if disk is not None and ideal else None
            seq = row.get("sequential_read_bytes_per_s")
            bound = (1 / tps) / (ideal / seq) if cold and tps and seq and ideal else None
            guess = _median([r.get("experts_expert_guess_accuracy") for r in mine])
            guessing = _median([r.get("experts_expert_guessing") for r in mine])
            lines.append(
                f"| {system} | {_f(tps)} | {_f(tps / inmem if tps and inmem else None)} | "
                f"{_f(tps / acc if tps and acc else None)} | {_gb(disk)} | {_gb(ideal or None)} | {_f(ratio)} | "
                f"{_f(bound)} | {_gb(row.get('peak_anon_rss_bytes'))} | {_f(guess)}"
                f"{'' if guessing is None else ' (on)' if guessing else ' (paused)'} | {row.get('matches_in_memory')} |"
            )
            rows_for_plot.append((f"{regime} {system}", tps or 0, disk or 0))
            if not system.startswith("ours") or not tps:
                continue
            if not cold and acc:
                targets.append(
                    f"- warm {system}: {tps / acc:.2f} × accelerate (≥ 1.5: {'met' if tps / acc >= 1.5 else 'not met'})"
                    + (
                        f", {tps / inmem:.2f} × in memory (≥ 0.6: {'met' if tps / inmem >= 0.6 else 'not met'})"
                        if inmem
                        else ""
                    )
                )
            if cold and acc:
                targets.append(
                    f"- cold {system}: {tps / acc:.2f} × accelerate (≥ 3: {'met' if tps / acc >= 3 else 'not met'})"
                    + (f", disk {ratio:.2f} × ideal (≤ 1.2: {'met' if ratio <= 1.2 else 'not met'})" if ratio else "")
                    + (
                        f", token {bound:.2f} × ideal time (≤ 1.25: {'met' if bound <= 1.25 else 'not met'})"
                        if bound
                        else ""
                    )
                )
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
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--preset", default="mixtral-2.6g", choices=sorted(PRESETS), help="the checkpoint to build")
    parser.add_argument("--budget", help="max_memory.cpu (default: a quarter of the model)")
    parser.add_argument("--tokens", type=int, default=6, help="new tokens per run (default: 6)")
    parser.add_argument("--reps", type=int, default=1, help="alternated repetitions per system (default: 1)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take (default: 600)")
    parser.add_argument(
        "--systems",
        type=lambda s: s.split(","),
        default=SYSTEMS,
        help="comma-separated systems as compare.py names them (default: every policy on both stores, in memory, "
        "accelerate)",
    )
    parser.add_argument("--warm-only", action="store_true", help="skip the cold page-cache runs")
    parser.add_argument("--cold-only", action="store_true", help="skip the warm page-cache runs")
    parser.add_argument("--report-only", action="store_true", help="redo the reports from the results' .json")
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
