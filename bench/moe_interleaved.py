"""Warm MoE decoding side by side in one process: in memory, accelerate and ours, one decode step each in turn.

On a shared machine whose load swings by several times within a minute, fresh-process runs of one system after
another (``bench/compare.py``) measure the load as much as the system. Here every system decodes the same
greedy tokens step by step, the systems taking turns at each step, so each ratio compares steps taken within
the same second. Complements (does not replace) ``bench/moe.py``: one process, so no RSS figures.

    python bench/moe_interleaved.py --steps 24          # writes bench/results/moe-interleaved-<preset>.md|json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

OURS = ["experts:safetensors", "experts+guess=none:safetensors", "experts:memmap", "prefetch:safetensors"]


def load_all(checkpoint: str, budget: int, scratch: Path, ours: list[str]) -> dict[str, torch.nn.Module]:
    import transformers
    from peers import load_accelerate

    import offload_core
    from offload_core.module_hooks.experts import Experts, ExpertsConfig

    models = {"inmem": transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()}
    spec = {
        "checkpoint": checkpoint,
        "dtype": "bfloat16",
        "budget": str(budget),
        "scratch": str(scratch / "acc"),
        "device": "cpu",
        "cpu_budget": budget,
    }
    models["accelerate"] = load_accelerate(spec)[0]
    for system in ours:
        policy, store = system.split(":")
        name, *options = policy.split("+")
        if name == "experts":
            policy = Experts(ExpertsConfig(**dict(o.split("=") for o in options)))
        models[f"ours:{system}"] = offload_core.from_pretrained(
            checkpoint,
            offload={
                "storage": store,
                "policy": policy if name == "experts" else name,
                "offload_folder": scratch / system,
            },
            max_memory={"cpu": budget},
            dtype=torch.bfloat16,
        )
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--preset", default="mixtral-2.6g")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per system")
    parser.add_argument("--systems", type=lambda s: s.split(","), default=OURS, help="ours: <policy>[+k=v]:<store>")
    args = parser.parse_args()
    from moe import CACHE, build

    checkpoint = str(build(args.preset))
    budget = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors")) // 4
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(dir=CACHE) as scratch, torch.inference_mode():
        models = load_all(checkpoint, budget, Path(scratch), args.systems)
        ids = torch.randint(1, 32000, (1, 30), generator=torch.Generator().manual_seed(0))
        state = {}
        for name, model in models.items():  # the prompt: not timed
            out = model(input_ids=ids, use_cache=True)
            state[name] = (out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True))
        times: dict[str, list[float]] = {name: [] for name in models}
        tokens: dict[str, list[int]] = {name: [] for name in models}
        order = list(models)
        for step in range(args.steps):
            for name in order[step % len(order) :] + order[: step % len(order)]:  # each system first in turn
                cache, token = state[name]
                started = time.perf_counter()
                out = models[name](input_ids=token, past_key_values=cache, use_cache=True)
                times[name].append(time.perf_counter() - started)
                state[name] = (out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True))
                tokens[name].append(int(state[name][1]))
        load.append(os.getloadavg())
    median = {name: statistics.median(t[2:]) for name, t in times.items()}  # the first two steps: warming up
    rows = [
        f"# Warm MoE decoding, interleaved: {args.preset}, max_memory.cpu {budget / 1e9:.2f} GB",
        "",
        f"{args.steps} greedy decode steps after a 30-token prompt, every system taking one step in turn (the first "
        f"two steps left out of the medians); load average {load[0][0]:.2f} {load[0][1]:.2f} at start, "
        f"{load[1][0]:.2f} {load[1][1]:.2f} at end. Command: `python bench/moe_interleaved.py --steps {args.steps}`.",
        "",
        "| system | median s/step | tok/s | × in memory | × accelerate | same tokens as in memory |",
        "|---|---|---|---|---|---|",
    ]
    for name in models:
        rows.append(
            f"| {name} | {median[name]:.4f} | {1 / median[name]:.2f} | {median['inmem'] / median[name]:.2f} | "
            f"{median['accelerate'] / median[name]:.2f} | {tokens[name] == tokens['inmem']} |"
        )
    out = HERE / "results" / f"moe-interleaved-{args.preset}"
    Path(f"{out}.md").write_text("\n".join(rows) + "\n")
    Path(f"{out}.json").write_text(
        json.dumps(
            {
                "budget": budget,
                "steps": args.steps,
                "loadavg": load,
                "times": times,
                "tokens": tokens,
                "median_s": median,
            },
            indent=1,
        )
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
