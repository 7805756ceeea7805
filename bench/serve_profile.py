"""Where a batched decoding step of the server's engine spends its time: torch's profiler over a run of steps with
every slot generating (SmolLM2 half offloaded, as ``bench/serve.py`` serves it), the operators' share of the CPU
time, with the batch KV cache keeping room for new columns (the engine's) and with transformers' dynamic cache
(which concatenates the whole cache every step), alternated. Writes ``bench/results/serve-profile-<tag>.json``
and ``.md``.

    python bench/serve_profile.py --rows 8 --steps 24 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def profiled(engine, steps: int) -> tuple[dict[str, float], list[float]]:
    """Each operator's self CPU seconds over ``steps`` steps, and each step's wall seconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    walls = []
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            began = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - began)
    return {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}, walls


def session(model, tokenizer, prompts: list[list[int]], rows: int, steps: int, room: bool) -> dict:
    import torch
    from transformers import DynamicCache

    from offload_core.serve.engine import Engine, Request
    from offload_core.serve.sampling import Params

    engine = Engine(model, tokenizer, torch.device("cpu"), slots=rows, context=512)
    if not room:
        engine.new_cache = lambda: DynamicCache(config=model.config)
    for i in range(rows):  # never ending early: every slot generates through the measured steps
        engine.submit(Request(prompts[i % len(prompts)], Params(max_tokens=steps + 8, temperature=0)))
    with torch.inference_mode():
        engine.step()  # the prefill of all rows, not measured
    ops, walls = profiled(engine, steps)
    total = sum(ops.values())
    return {"room": room, "step_s_median": statistics.median(walls), "cpu_s": total, "ops": ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", default="230MiB", help="max_memory cpu of the weights (default: about half)")
    parser.add_argument("--tag", default="smollm2")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    import transformers

    import offload_core
    from offload_core.loading.sources import smollm2_checkpoint

    folder = smollm2_checkpoint()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    lines = [line.strip() for line in (HERE / "prompts.txt").read_text().splitlines() if line.strip()]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
            )
        )
        for p in lines
    ]
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve-profile-{os.getpid()}"
    model = offload_core.from_pretrained(
        folder, offload={"headroom": 0, "offload_folder": scratch}, max_memory={"cpu": args.budget}
    )
    load = [os.getloadavg()[0]]
    runs = []
    for r in range(args.rounds):
        for room in (True, False) if r % 2 == 0 else (False, True):
            runs.append({"round": r + 1, **session(model, tokenizer, prompts, args.rows, args.steps, room)})
            load.append(os.getloadavg()[0])
    write(args, runs, load, model.offload_state.offloaded_bytes())


def write(args, runs: list[dict], load: list[float], offloaded: int) -> None:
    def share(run: dict, *names: str) -> float:
        return sum(v for k, v in run["ops"].items() if k in names) / run["cpu_s"]

    groups = {
        "matmul (aten::mm, addmm)": ("aten::mm", "aten::addmm", "aten::bmm"),
        "KV cache concatenation (aten::cat)": ("aten::cat",),
        "KV cache writes into room (aten::copy_)": ("aten::copy_",),
        "attention (scaled dot product)": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
        "rows leaving (aten::index_select)": ("aten::index_select",),
    }
    lines = [
        f"# Serve: where a batched decoding step goes ({args.tag})",
        "",
        f"The engine on SmolLM2 with {offloaded / 2**20:.1f} MiB of its weights offloaded (`max_memory.cpu="
        f"{args.budget}` of weights), {args.rows} requests generating at once, {args.steps} decoding steps profiled "
        f"by torch's profiler per run, {args.rounds} rounds alternating the two caches; load average "
        + ", ".join(f"{x:.2f}" for x in load)
        + " (a busy machine: read the shares, not the seconds).",
        "",
        f"Command: `python bench/serve_profile.py --rows {args.rows} --steps {args.steps} --rounds {args.rounds} "
        f"--tag {args.tag}`",
        "",
        "| round | KV cache | step wall s (median) | " + " | ".join(groups) + " |",
        "|---|---|---|" + "---|" * len(groups),
    ]
    for run in runs:
        kind = "with room (the engine's)" if run["room"] else "transformers' dynamic (concatenates)"
        cells = " | ".join(f"{100 * share(run, *names):.1f}%" for names in groups.values())
        lines.append(f"| {run['round']} | {kind} | {run['step_s_median']:.3f} | {cells} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"serve-profile-{args.tag}.md").write_text("\n".join(lines) + "\n")
    kept = [{**r, "ops": dict(sorted(r["ops"].items(), key=lambda kv: -kv[1])[:25])} for r in runs]
    (out / f"serve-profile-{args.tag}.json").write_text(json.dumps({"runs": kept, "load": load}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
