"""Soak: 2,000 forward calls per module-hook policy on a synthetic Llama with its weights on disk; anonymous RSS and
open file descriptors before and after.

Each policy runs in a fresh process so one policy's leftovers cannot hide or inflate another's.
Writes ``bench/results/soak.json``.

    python bench/soak.py                       # tiny preset, 2,000 calls per policy
    python bench/soak.py --preset small --calls 500
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
POLICIES = ("align_per_call", "chained", "functional_call", "prefetch")


def anon_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def soak_one(policy: str, preset: str, calls: int, warmup: int, seq: int) -> dict:
    """Load the preset with everything offloaded to a temporary memmap folder, then call forward ``calls`` times."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from offload_core import init_empty_weights, load_checkpoint_and_dispatch
    from offload_core.loading import sources

    checkpoint = sources.synthetic_checkpoint(**sources.synthetic_preset(preset))
    config = AutoConfig.from_pretrained(checkpoint)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    load_checkpoint_and_dispatch(
        model, checkpoint, device_map, storage="memmap", policy=policy, execution_device="cpu", progress=False
    )
    ids = torch.arange(1, seq + 1).unsqueeze(0) % config.vocab_size
    with torch.inference_mode():
        for _ in range(warmup):
            model(ids)
        gc.collect()
        before = {"anon_rss_bytes": anon_rss(), "open_fds": open_fds()}
        started = time.perf_counter()
        for _ in range(calls):
            model(ids)
        seconds = time.perf_counter() - started
        gc.collect()
        after = {"anon_rss_bytes": anon_rss(), "open_fds": open_fds()}
    model.offload_state.remove()
    return {
        "policy": policy,
        "preset": preset,
        "calls": calls,
        "warmup_calls": warmup,
        "sequence_length": seq,
        "before": before,
        "after": after,
        "anon_rss_growth_bytes": after["anon_rss_bytes"] - before["anon_rss_bytes"],
        "open_fds_growth": after["open_fds"] - before["open_fds"],
        "seconds": seconds,
        "ms_per_call": 1000 * seconds / calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", default=str(HERE / "results" / "soak.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # worker mode: run one policy, print its JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(soak_one(args.one, args.preset, args.calls, args.warmup, args.seq)))
        return
    runs = []
    for policy in args.policies.split(","):
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                policy,
                "--preset",
                args.preset,
                "--calls",
                str(args.calls),
                "--warmup",
                str(args.warmup),
                "--seq",
                str(args.seq),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append(run)
        print(
            f"{policy:>16}: {run['calls']} calls, {run['ms_per_call']:.2f} ms/call, anon RSS "
            f"{run['before']['anon_rss_bytes'] / 2**20:.1f} -> {run['after']['anon_rss_bytes'] / 2**20:.1f} MiB "
            f"({run['anon_rss_growth_bytes'] / 2**10:+.0f} KiB), fds {run['before']['open_fds']} -> "
            f"{run['after']['open_fds']}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"machine": platform.platform(), "python": platform.python_version(), "runs": runs}, indent=1) + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
