"""The reports of ``bench/compare.py``: the markdown tables (ratios, targets, notes) and the plot, written from a
results dict."""

from __future__ import annotations

import json
from pathlib import Path


def _gb(value) -> str:
    return "–" if value is None else f"{value / 1e9:.2f}"


def _f(value, digits=2, suffix="") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def write_markdown(data: dict, path: Path) -> None:
    med, args, m = data["medians"], data["args"], data["machine"]
    cold = args["cold"]
    gpu = args.get("device") == "cuda"
    setting = (
        f"max_memory.0={args['budget']} on {m.get('gpu')}, the rest in host memory"
        if gpu
        else f"max_memory.cpu={args['budget']}{', cold page cache' if cold else ', warm page cache'}"
    )
    lines = [
        f"# offload benchmark: synthetic {args['preset'] or args['checkpoint']}, {setting}",
        "",
        f"Checkpoint: {_gb(data['checkpoint_bytes'])} GB ({args['dtype']}), {args['tokens']} new tokens (greedy) after "
        f"a {data['prompt_tokens']}-token prompt, {args['reps']} repetitions per system, systems in alternation, each "
        "run in a fresh process. Medians; sizes in GB (10^9 bytes); RSS figures are peaks minus the process's baseline "
        "after imports.",
        "",
        f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['ram_bytes'] / 2**30:.1f} GiB RAM, Linux {m['kernel']}, torch "
        f"{m['torch']}, transformers {m['transformers']}, accelerate {m['accelerate']}, offload_core {m['commit']}. "
        f"Load average {data['loadavg_start']} at start, {data['loadavg_end']} at end (other jobs share these cores: "
        "compare ratios, not absolute figures).",
        "",
        "Reproduce:",
        "",
        "```bash",
        data["command"],
        "```",
        "",
        "| system | load s | first token s | load→first token s | decode tok/s (min–max) | × in-mem | × accelerate | "
        "load→1st × accelerate | peak anon RSS Δ | peak file RSS Δ | bytes read/token | read GB/s | written at load | "
        "same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, r in med.items():
        if not r["runs"]:
            lines.append(f"| {system} | failed ({r['failed']} runs) |" + " |" * 13)
            continue
        tps = r["decode_tokens_per_s"]
        spread = f" ({r['decode_tokens_per_s_min']:.2f}–{r['decode_tokens_per_s_max']:.2f})" if tps is not None else ""
        lines.append(
            f"| {system} | {_f(r['load_s'])} | {_f(r['time_to_first_token_s'])} | {_f(r['load_to_first_token_s'])} | "
            f"{_f(tps)}{spread} | {_f(r['decode_vs_inmem'])} | {_f(r['decode_vs_accelerate'])} | "
            f"{_f(r['load_to_first_token_vs_accelerate'])} | {_gb(r['peak_anon_rss_bytes'])} | "
            f"{_gb(r['peak_file_rss_bytes'])} | {_gb(r['bytes_read_per_token'])} | "
            f"{_f(r['read_bandwidth_bytes_per_s'] and r['read_bandwidth_bytes_per_s'] / 1e9)} | "
            f"{_gb(r['store_bytes_written'])} | {r['matches_in_memory']} |"
        )
    if cold:
        lines += [
            "",
            "Cold page cache: before the prompt and before each new token the offloaded data files (the offload "
            "folder's `.dat` files; for `safetensors`, the checkpoint shards holding offloaded tensors) are dropped "
            "from the page cache (`madvise(MADV_DONTNEED)` on this process's maps of them, then "
            "`posix_fadvise(DONTNEED)`); the time spent dropping is not counted. Files written at load are flushed to "
            "the disk (`sync`) before decoding. The same bytes are read sequentially (16 MiB reads, cache dropped "
            "first) three times before decoding and twice after, to measure the disk's bandwidth in the same run; the "
            "median of the five is used.",
            "",
            "| system | decode s/token | offloaded GB/token | sequential read GB/s | ideal read s/token "
            "| token ÷ ideal | disk read GB/token | disk GB/s while decoding | cached after drop "
            "| prefetch: compute waited s/token |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for system, r in med.items():
            if not r["runs"] or not r["bytes_read_per_token"]:
                continue
            lines.append(
                f"| {system} | {_f(r['decode_token_mean_s'])} | {_gb(r['bytes_read_per_token'])} | "
                f"{_f(r['sequential_read_bytes_per_s'] and r['sequential_read_bytes_per_s'] / 1e9)} | "
                f"{_f(r['ideal_read_s_per_token'])} | {_f(r['cold_token_over_ideal'])} | "
                f"{_gb(r['disk_read_bytes_per_token'])} | "
                f"{_f(r['disk_read_bandwidth_bytes_per_s'] and r['disk_read_bandwidth_bytes_per_s'] / 1e9)} | "
                f"{_f(r['cached_fraction_after_drop_max'] and 100 * r['cached_fraction_after_drop_max'], 1, '%')} | "
                f"{_f(r.get('prefetch_wait_s_per_token'), 3)} |"
            )
    if gpu:
        lines += [
            "",
            "GPU: the pinned host → GPU bandwidth is measured in every run (256 MiB copies from pinned memory, median "
            "of 7, before and after generating; the better one is kept). The ideal is a decode token's moved bytes "
            "at that bandwidth (the prompt's, which some policies read whole, left out).",
            "",
            "| system | decode s/token | moved GB/decode token | pinned H2D GB/s | ideal s/token | token ÷ ideal "
            "| peak GPU GB | prefetch: compute waited s/token |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for system, r in med.items():
            if r["runs"]:
                lines.append(
                    f"| {system} | {_f(r['decode_token_mean_s'], 3)} | "
                    f"{_gb(r.get('bytes_moved_per_decode_token') or r['bytes_read_per_token'])} | "
                    f"{_f(r['h2d_bytes_per_s'] and r['h2d_bytes_per_s'] / 1e9)} | {_f(r['ideal_h2d_s_per_token'], 3)} "
                    f"| {_f(r['h2d_token_over_ideal'])} | {_gb(r['peak_gpu_bytes'])} | "
                    f"{_f(r.get('prefetch_wait_s_per_token'), 3)} |"
                )
    hybrid = [system for system, r in med.items() if system.endswith(":hybrid") and r["runs"]]
    if gpu and hybrid:
        lines += [
            "",
            "hybrid=true: decoding steps compute a planned share of the offloaded blocks on the host while the others "
            "stream; the copy-only bound streams every offloaded byte at the run's pinned H2D bandwidth; token "
            "agreement is the share of positions equal to the in-memory run's (CPU/GPU rounding may differ).",
            "",
            "| system | decode s/token | copy-only bound s/token | token ÷ copy-only bound | host s/token "
            "| token agreement | peak GPU GB |",
            "|---|---|---|---|---|---|---|",
        ]
        for system in hybrid:
            r = med[system]
            lines.append(
                f"| {system} | {_f(r['decode_token_mean_s'], 3)} | {_f(r.get('copy_only_s_per_token'), 3)} | "
                f"{_f(r.get('token_over_copy_only'))} | {_f(r.get('prefetch_host_s_per_token'), 3)} | "
                f"{_f(r.get('token_agreement') and 100 * r['token_agreement'], 1, '%')} | {_gb(r['peak_gpu_bytes'])} |"
            )
    lines += ["", "## Targets", "", "| target | system | figure | bound | met |", "|---|---|---|---|---|"]
    for name, per_system in data["targets"].items():
        for system, t in per_system.items():
            value, bound = t["value"], t["bound"]
            if "RSS" in name or "peak GPU" in name:
                shown, limit = f"{value / 1e9:.2f} GB", f"{bound / 1e9:.2f} GB"
            elif "overhead" in name:
                shown, limit = f"{100 * value:+.1f}%", f"{100 * bound:.0f}%"
            else:
                shown, limit = f"{value:.2f}×", f"{bound:.2f}×"
            lines.append(f"| {name} | {system} | {shown} | {limit} | {'yes' if t['met'] else '**no**'} |")
    lines += ["", "Columns: see `bench/README.md`."]
    if data.get("notes"):
        lines += ["", "## Notes", "", *(f"- {note}" for note in data["notes"])]
    path.write_text("\n".join(lines) + "\n")


def write_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = {s: r for s, r in data["medians"].items() if r["runs"]}
    names = list(med)
    short = [
        n.replace("ours:", "")
        .replace("align_per_call", "align")
        .replace("functional_call", "functional")
        .replace("safetensors", "st")
        .replace("pinned_cpu", "pinned")
        for n in names
    ]
    cold = data["args"]["cold"]
    panels = 4 if cold else 3
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 5.5))
    colors = ["tab:gray" if n == "inmem" else "tab:red" if n == "accelerate" else "tab:blue" for n in names]
    y = range(len(names))

    ax = axes[0]
    tps = [med[n]["decode_tokens_per_s"] or 0 for n in names]
    lo = [t - (med[n].get("decode_tokens_per_s_min") or t) for n, t in zip(names, tps)]
    hi = [(med[n].get("decode_tokens_per_s_max") or t) - t for n, t in zip(names, tps)]
    ax.barh(y, tps, xerr=[lo, hi], color=colors)
    ax.set_title("decode tokens/s (median, min–max)")
    ax.set_yticks(list(y), short)
    ax.invert_yaxis()

    ax = axes[1]
    load = [med[n]["load_s"] or 0 for n in names]
    ttft = [med[n]["time_to_first_token_s"] or 0 for n in names]
    ax.barh(y, load, color=colors, label="load")
    ax.barh(y, ttft, left=load, color=colors, alpha=0.45, label="first token")
    ax.set_title("load → first token, s")
    ax.set_yticks(list(y), [])
    ax.invert_yaxis()
    ax.legend(loc="lower right")

    ax = axes[2]
    anon = [(med[n]["peak_anon_rss_bytes"] or 0) / 1e9 for n in names]
    file = [(med[n]["peak_file_rss_bytes"] or 0) / 1e9 for n in names]
    ax.barh([i - 0.2 for i in y], anon, height=0.4, color="tab:purple", label="anonymous")
    ax.barh([i + 0.2 for i in y], file, height=0.4, color="tab:olive", label="file-backed")
    ax.axvline(data["budget_bytes"] / 1e9, color="black", ls="--", label=f"budget {data['args']['budget']}")
    ax.set_title("peak RSS − baseline, GB")
    ax.set_yticks(list(y), [])
    ax.invert_yaxis()
    ax.legend(loc="lower right")

    if cold:
        ax = axes[3]
        token = [med[n]["decode_token_mean_s"] or 0 for n in names]
        ideal = [med[n]["ideal_read_s_per_token"] or 0 for n in names]
        ax.barh([i - 0.2 for i in y], token, height=0.4, color=colors, label="decode s/token")
        ax.barh([i + 0.2 for i in y], ideal, height=0.4, color="tab:orange", label="offloaded bytes ÷ seq. bandwidth")
        ax.set_title("cold cache: s/token vs ideal read time")
        ax.set_yticks(list(y), [])
        ax.invert_yaxis()
        ax.legend(loc="lower right")

    args = data["args"]
    fig.suptitle(
        f"synthetic {args['preset']} ({args['dtype']}), max_memory.cpu={args['budget']}, "
        f"{'cold' if cold else 'warm'} page cache, {args['reps']} reps, {data['machine']['nproc']} CPUs"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _with(stem: Path, suffix: str) -> Path:
    return stem.parent / (stem.name + suffix)  # not with_suffix: "compare-0.3b" has a dot


def write_reports(data: dict, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    _with(stem, ".json").write_text(json.dumps(data, indent=1, default=str))
    write_markdown(data, _with(stem, ".md"))
    write_plot(data, _with(stem, ".png"))
