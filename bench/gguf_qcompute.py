"""The main job's GGUF (SmolLM2) read in place, exact (``storage=gguf``, the default) against quantized compute
(``storage=gguf storage.compute=quantized``): decode speed with the whole model resident (warm) and with half its
decoder layers offloaded (a device map, the same for both), bytes moved per generated token, token agreement with the
exact mode over bench/prompts.txt and the perplexity of a fixed text. Written to bench/results/gguf-qcompute.{json,md}.

    python bench/gguf_qcompute.py              # 2 rounds of 4 runs (modes alternated), then the quality figures
    python bench/gguf_qcompute.py --rounds 3 --new-tokens 48

The fixed text is the first ``--text-tokens`` tokens of the history section of this Python's own LICENSE.txt (the
same on every machine with the same Python version; the report names it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parent.parent
MODES = {"exact": ["storage=gguf"], "quantized": ["storage=gguf", "storage.compute=quantized"]}
LAYERS = 30  # SmolLM2-135M's decoder layers


def half_map(path: Path) -> Path:
    """A device map putting the second half of the decoder layers on disk (everything else in memory)."""
    mapping = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    for layer in range(LAYERS):
        mapping[f"model.layers.{layer}"] = "cpu" if layer < LAYERS // 2 else "disk"
    path.write_text(json.dumps(mapping))
    return path


CONDITIONS = {"warm, resident": ["max_memory.cpu=2GiB"], "half offloaded": []}


def run(args: list[str], out: Path) -> dict:
    """One ``python run.py`` process: the figures of its metrics kept here."""
    command = [sys.executable, "run.py", "progress=false", f"hydra.run.dir={out}", *args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-2000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    names = ("decode_tokens_per_s", "bytes_moved_per_token", "offloaded_bytes", "time_to_first_token_s")
    row = {name: metrics.get(name) for name in names}
    row["token_ids"] = metrics.get("token_ids")
    row["load_average"] = os.getloadavg()[0]
    return row


def speeds(rounds: int, tmp: Path) -> dict:
    """Each condition x mode run ``rounds`` times, the modes alternated; the best decode speed of each kept."""
    device_map = half_map(tmp / "half.json")
    runs: dict[str, dict[str, list[dict]]] = {c: {m: [] for m in MODES} for c in CONDITIONS}
    for index in range(rounds):
        for condition, extra in CONDITIONS.items():
            if condition == "half offloaded":
                extra = [f"device_map={device_map}", "max_memory.cpu=2GiB"]
            for mode, args in MODES.items():
                row = run([*args, *extra], tmp / f"{index}-{mode}-{len(runs[condition][mode])}-{condition[:4]}")
                runs[condition][mode].append(row)
                print(condition, mode, row["decode_tokens_per_s"], row["bytes_moved_per_token"], flush=True)
    return runs


def fixed_text() -> tuple[str, str]:
    """The fixed text (the history section of this Python's LICENSE.txt, lines joined) and where it comes from."""
    source = Path(os.__file__).parent / "LICENSE.txt"
    return " ".join(source.read_text(encoding="utf-8").split()), f"{source.name} of Python {platform.python_version()}"


def quality(new_tokens: int, text_tokens: int) -> dict:
    """Greedy answers to bench/prompts.txt in both modes (whole sequences equal, the share of the exact answer's
    tokens before the first difference, the share of its positions where the quantized model's next token agrees
    given the exact prefix) and the perplexity of the fixed text in each."""
    import offload_core
    from offload_core.loading.gguf_checkpoint import gguf_tokenizer
    from offload_core.loading.sources import smollm2_gguf_path
    from offload_core.registry.manager import get_registry
    from offload_core.runner.inputs import prompt_ids

    path = smollm2_gguf_path()
    tokenizer = gguf_tokenizer(path)
    stores = {"exact": "gguf", "quantized": get_registry().create("storage", "gguf", {"compute": "quantized"})}
    models = {
        m: offload_core.from_pretrained(path, offload={"storage": s}, max_memory={"cpu": "2GiB"})
        for m, s in stores.items()
    }
    prompts = [line for line in (REPO / "bench" / "prompts.txt").read_text().splitlines() if line.strip()]
    answers: dict[str, list[list[int]]] = {mode: [] for mode in models}
    agree = total = prefix = same = 0
    with torch.no_grad():
        for prompt in prompts:
            ids = prompt_ids(tokenizer, prompt, True, models["exact"].config.vocab_size)
            for mode, model in models.items():
                out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
                answers[mode].append(out[0, ids.shape[1] :].tolist())
            exact, quant = answers["exact"][-1], answers["quantized"][-1]
            same += exact == quant
            common = next((i for i, (a, b) in enumerate(zip(exact, quant)) if a != b), min(len(exact), len(quant)))
            prefix += common
            full = torch.tensor([ids[0].tolist() + exact])
            logits = models["quantized"](full).logits[0, ids.shape[1] - 1 : -1]
            agree += int((logits.argmax(-1) == torch.tensor(exact)).sum())
            total += len(exact)
        text, source = fixed_text()
        tokens = tokenizer(text, return_tensors="pt")["input_ids"][:, :text_tokens]
        perplexity = {m: float(torch.exp(model(tokens, labels=tokens).loss)) for m, model in models.items()}
    for model in models.values():
        model.offload_state.release()
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "same_answers": same,
        "prefix_share": prefix / total,
        "next_token_agreement": agree / total,
        "answers": answers,
        "text": source,
        "text_tokens": int(tokens.shape[1]),
        "perplexity": perplexity,
    }


def report(runs: dict, figures: dict, out: Path) -> None:
    cores, load = psutil.cpu_count(), os.getloadavg()
    rows = []
    for condition, modes in runs.items():
        for mode, items in modes.items():
            best = max(items, key=lambda r: r["decode_tokens_per_s"])
            rows.append(
                {
                    "condition": condition,
                    "mode": mode,
                    "decode_tokens_per_s": best["decode_tokens_per_s"],
                    "all_decode_tokens_per_s": [r["decode_tokens_per_s"] for r in items],
                    "bytes_moved_per_token": best["bytes_moved_per_token"],
                    "load_average": statistics.mean(r["load_average"] for r in items),
                }
            )
    by = {(r["condition"], r["mode"]): r for r in rows}
    ratios = {c: by[(c, "quantized")]["decode_tokens_per_s"] / by[(c, "exact")]["decode_tokens_per_s"] for c in runs}
    moved = by[("half offloaded", "quantized")]["bytes_moved_per_token"]
    moved_ratio = moved / by[("half offloaded", "exact")]["bytes_moved_per_token"]
    data = {"rows": rows, "ratios": ratios, "moved_ratio": moved_ratio, "quality": figures, "cores": cores}
    data["load_average_end"] = load[0]
    out.mkdir(parents=True, exist_ok=True)
    (out / "gguf-qcompute.json").write_text(json.dumps(data, indent=2) + "\n")
    ppl = figures["perplexity"]
    lines = [
        "# Quantized compute (`storage.compute=quantized`) against the exact mode, SmolLM2's GGUF",
        "",
        f"{platform.machine()}, {cores} cores, torch {torch.__version__}; load average "
        + ", ".join(f"{r['load_average']:.1f}" for r in rows)
        + f" over the rows below, {load[0]:.1f} at the end (a shared machine: speeds are noisy, the ratios within "
        "a round mean more). `python bench/gguf_qcompute.py` reproduces it.",
        "",
        "| condition | mode | decode (best of rounds) | every round | bytes moved / token |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        each = ", ".join(f"{v:.2f}" for v in r["all_decode_tokens_per_s"])
        lines.append(
            f"| {r['condition']} | {r['mode']} | {r['decode_tokens_per_s']:.2f} tok/s | {each} | "
            f"{r['bytes_moved_per_token'] / 2**20:.1f} MiB |"
        )
    lines += [
        "",
        f"Quantized over exact: {ratios['warm, resident']:.2f}x the decode speed warm and resident, "
        f"{ratios['half offloaded']:.2f}x half offloaded, moving {moved_ratio:.2f}x the bytes per token "
        f"({moved / 2**20:.1f} MiB).",
        "",
        f"Quality, greedy, {figures['new_tokens']} new tokens for each of the {figures['prompts']} prompts of "
        f"bench/prompts.txt: {figures['same_answers']} of {figures['prompts']} answers identical to the exact mode's; "
        f"{figures['prefix_share']:.1%} of the exact answers' tokens come before the first difference; given the exact "
        f"answer as prefix, the quantized model's next token agrees at {figures['next_token_agreement']:.1%} of "
        f"positions. Perplexity of a fixed text ({figures['text_tokens']} tokens of {figures['text']}, its history "
        f"section): exact {ppl['exact']:.3f}, quantized {ppl['quantized']:.3f} "
        f"({ppl['quantized'] / ppl['exact'] - 1:+.2%}).",
    ]
    (out / "gguf-qcompute.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--text-tokens", type=int, default=320)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runs = speeds(args.rounds, Path(tmp))
    figures = quality(args.new_tokens, args.text_tokens)
    report(runs, figures, args.out)
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
