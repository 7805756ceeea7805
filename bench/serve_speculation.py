"""Speculation inside the server: the same greedy requests, on a text they repeat, served with ``speculative=none``
and ``speculative=prompt_lookup``: forward passes, tokens per pass, drafted and accepted tokens, aggregate tokens/s,
bytes moved per generated token, and whether every answer's text is the same both ways.

Starts ``python run.py mode=serve`` (SmolLM2 half offloaded, as ``bench/serve.py``) once per speculation and sends
each client's requests with the ``openai`` client. Writes ``bench/results/serve-speculation-<tag>.json`` and ``.md``.

    python bench/serve_speculation.py --clients 1,4 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve import DEFAULT_ARGS, ask, concurrently, connect, start  # noqa: E402

PARAGRAPHS = [
    "Offloaded weights are streamed from disk around each module's forward, once per pass for every request.",
    "The quick brown fox jumps over the lazy dog, and the lazy dog does not move at all.",
    "A server shares each pass over the streamed weights between the requests that generate together.",
    "Paris is the capital of France; Berlin is the capital of Germany; Rome is the capital of Italy.",
]


def prompts() -> list[str]:
    """Requests whose answer repeats text of the prompt (what prompt lookup drafts from)."""
    return [f"Repeat this text exactly, twice:\n\n{p}" for p in PARAGRAPHS]


def serve(server_args: list[str], clients: list[int], tokens: int, scratch: Path) -> dict:
    """One server: the figures of each load and every answer's text."""
    proc, url = start(server_args, scratch)
    loads, texts = [], {}
    try:
        client = connect(url)
        ask(client, "Hello", 4)  # warm-up: first touch of every weight
        for count in clients:
            answers: dict[int, dict] = {}
            asked = prompts()[:count] if count <= len(PARAGRAPHS) else prompts() * (count // len(PARAGRAPHS) + 1)
            calls = [
                lambda i=i, p=p: answers.__setitem__(i, ask(client, p, tokens)) for i, p in enumerate(asked[:count])
            ]
            wall, delta = concurrently(url, calls)
            generated = delta["offload_core_serve_generated_tokens_total"]
            passes = delta["offload_core_serve_forward_passes_total"]
            texts[count] = [answers[i]["text"] for i in range(count)]
            loads.append(
                {
                    "clients": count,
                    "generated_tokens": int(generated),
                    "forward_passes": int(passes),
                    "tokens_per_pass": generated / passes if passes else None,
                    "drafted_tokens": int(delta.get("offload_core_serve_drafted_tokens_total", 0)),
                    "accepted_tokens": int(delta.get("offload_core_serve_accepted_tokens_total", 0)),
                    "seconds": wall,
                    "aggregate_tokens_per_s": generated / wall,
                    "bytes_moved_per_token": delta["offload_core_serve_bytes_moved"] / generated if generated else None,
                }
            )
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return {"loads": loads, "texts": texts}


def report(result: dict) -> str:
    lines = [
        f"# Serve with speculation: {result['tag']}",
        "",
        f"`python run.py mode=serve {' '.join(result['server_args'])} speculative=...`, {result['tokens']} greedy "
        f"tokens per request, prompts that ask to repeat a text; machine: {result['machine']}, offload_core "
        f"{result['commit']}, load average {result['loadavg_start']} at start, {result['loadavg_end']} at end",
        "",
        "| speculative | clients | passes | tokens/pass | accepted/drafted | aggregate tok/s | MiB moved/token |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in result["runs"].items():
        for row in run["loads"]:
            lines.append(
                f"| {name} | {row['clients']} | {row['forward_passes']} | {row['tokens_per_pass']:.2f} | "
                f"{row['accepted_tokens']}/{row['drafted_tokens']} | {row['aggregate_tokens_per_s']:.1f} | "
                f"{row['bytes_moved_per_token'] / 2**20:.1f} |"
            )
    lines += ["", f"Every answer's text the same with and without speculation: {result['same_text']}."]
    return "\n".join(lines) + "\n"


def commit() -> str:
    import subprocess

    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--clients", default="1,4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--tag", default="smollm2-half-offloaded")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("server_args", nargs="*", help="run.py keys (default: %(default)s)", default=DEFAULT_ARGS)
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    runs, loadavg_start = {}, round(os.getloadavg()[0], 1)
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("none", "prompt_lookup"):
            runs[name] = serve([*args.server_args, f"speculative={name}"], clients, args.tokens, Path(scratch) / name)
    result = {
        "tag": args.tag,
        "server_args": args.server_args,
        "tokens": args.tokens,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "commit": commit(),
        "loadavg_start": loadavg_start,
        "loadavg_end": round(os.getloadavg()[0], 1),
        "runs": runs,
        "same_text": runs["none"]["texts"] == runs["prompt_lookup"]["texts"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"serve-speculation-{args.tag}.json").write_text(json.dumps(result, indent=1))
    (out / f"serve-speculation-{args.tag}.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
