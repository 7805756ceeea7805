"""The server under load: aggregate generated tokens/s, time to first token, tokens per pass and bytes moved per
generated token at 1, 4 and 8 concurrent clients, and how often a greedy request batched with others gets other tokens
than alone (batch rounding; ``serve.exact=true`` never does).

Starts ``python run.py mode=serve`` (SmolLM2 by default, with a budget that puts about half of it on disk) on a free
loopback port, drives it with the ``openai`` client (streaming, greedy) and reads its ``/metrics``. Writes
``bench/results/serve-<tag>.json`` and ``.md``.

    python bench/serve.py --clients 1,4,8 --tokens 32 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: SmolLM2 (513 MiB in float32) with 8 requests of 512 tokens planned: about 55% of its weights on disk
DEFAULT_ARGS = ["max_memory.cpu=500MiB", "serve.context=512", "serve.max_batch=8"]


def start(args: list[str], run_dir: Path) -> tuple[subprocess.Popen, str]:
    """The server process and its URL once it prints that it serves."""
    proc = subprocess.Popen(
        [sys.executable, "run.py", "mode=serve", "serve.port=0", "progress=false", f"hydra.run.dir={run_dir}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        found = re.search(r"^serving .* on (http://127\.0\.0\.1:\d+)", line)
        if found:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, found.group(1)
    raise SystemExit("the server did not start:\n" + "".join(seen[-30:]))


def metrics(url: str) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=60).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(offload_core_serve_\w+) (\S+)$", text, re.M)}


def ask(client, prompt: str, tokens: int) -> dict:
    """One streamed greedy chat request: its text, tokens, time to first token and total time."""
    began = time.perf_counter()
    first, pieces, count = None, [], 0
    stream = client.chat.completions.create(
        model=client.served,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - began
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            count = chunk.usage.completion_tokens
    return {"text": "".join(pieces), "tokens": count, "ttft_s": first, "seconds": time.perf_counter() - began}


def connect(url: str):
    """An ``openai`` client of the server, ``client.served`` the name of the model it serves."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    client.served = client.models.list().data[0].id
    return client


def concurrently(url: str, calls: list) -> tuple[float, dict[str, float]]:
    """Run ``calls`` at once, each on a thread of its own: the wall time, and how much each of the server's counters
    (``/metrics``) grew meanwhile."""
    before = metrics(url)
    threads = [threading.Thread(target=call) for call in calls]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    after = metrics(url)
    return wall, {k: after.get(k, 0) - before.get(k, 0) for k in after}


def load(url: str, prompts: list[str], clients: int, rounds: int, tokens: int) -> dict:
    """``clients`` threads, each sending ``rounds`` requests one after another; the aggregate figures."""
    client = connect(url)
    results: list[dict] = []

    def worker(c: int) -> None:
        for r in range(rounds):
            results.append(ask(client, prompts[(c + r * clients) % len(prompts)], tokens))

    wall, delta = concurrently(url, [lambda c=c: worker(c) for c in range(clients)])
    generated = delta["offload_core_serve_generated_tokens_total"]
    passes = delta["offload_core_serve_forward_passes_total"]
    ttft = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
    return {
        "clients": clients,
        "requests": len(results),
        "generated_tokens": int(generated),
        "seconds": wall,
        "aggregate_tokens_per_s": generated / wall,
        "tokens_per_pass": generated / passes if passes else None,
        "bytes_moved_per_token": delta["offload_core_serve_bytes_moved"] / generated if generated else None,
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p95_s": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))] if ttft else None,
    }


def batched_vs_alone(url: str, prompts: list[str], tokens: int) -> dict:
    """Every prompt alone, then all at once: how many of them got other text batched than alone."""
    client = connect(url)
    alone = [ask(client, p, tokens)["text"] for p in prompts]
    together: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: together.__setitem__(i, ask(client, prompts[i], tokens)["text"]))
        for i in range(len(prompts))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    differ = [i for i in range(len(prompts)) if together[i] != alone[i]]
    return {"prompts": len(prompts), "differ_from_alone": len(differ), "which": differ}


def report(result: dict) -> str:
    lines = [
        f"# Serve: {result['tag']}",
        "",
        f"`python run.py mode=serve {' '.join(result['server_args'])}`, {result['tokens']} greedy tokens per request, "
        f"{result['rounds']} requests per client one after another; machine: {result['machine']}",
        "",
        "| clients | aggregate tok/s | tokens/pass | bytes moved/token | vs 1 client | TTFT p50 s | TTFT p95 s |",
        "|---|---|---|---|---|---|---|",
    ]
    one = result["loads"][0]["bytes_moved_per_token"] or 0
    for row in result["loads"]:
        share = row["bytes_moved_per_token"] / one if one else float("nan")
        lines.append(
            f"| {row['clients']} | {row['aggregate_tokens_per_s']:.1f} | {row['tokens_per_pass']:.2f} | "
            f"{row['bytes_moved_per_token'] / 2**20:.1f} MiB | {share:.3f}x | {row['ttft_p50_s']:.2f} | "
            f"{row['ttft_p95_s']:.2f} |"
        )
    exact = result.get("exactness")
    if exact:
        lines += [
            "",
            f"Batched against alone ({exact['prompts']} prompts sent at once, greedy): "
            f"{exact['differ_from_alone']} got other text than alone (serve.exact=true: none by construction).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tag", default="smollm2-half-offloaded")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("server_args", nargs="*", help="run.py keys (default: %(default)s)", default=DEFAULT_ARGS)
    args = parser.parse_args()
    prompts = [line.strip() for line in (HERE / "prompts.txt").read_text().splitlines() if line.strip()]
    import platform
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        proc, url = start(args.server_args, Path(scratch) / "run")
        try:
            load(url, prompts, 1, 1, 4)  # warm-up: first touch of every weight
            loads = [load(url, prompts, int(c), args.rounds, args.tokens) for c in args.clients.split(",")]
            exact = batched_vs_alone(url, prompts, args.tokens)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    result = {
        "tag": args.tag,
        "server_args": args.server_args,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "loads": loads,
        "exactness": exact,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"serve-{args.tag}.json").write_text(json.dumps(result, indent=1))
    (out / f"serve-{args.tag}.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
