"""The server kept busy: many clients (default 32) for a while (default 10 minutes), each sending greedy streamed
requests of random length, a share of them going away after their first token; reports the errors, p50/p95 time to
first token and inter-token latency, and the server's resident memory over time (flat: no leak).

    python bench/serve_soak.py --clients 32 --minutes 10
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve import DEFAULT_ARGS, connect, metrics, start  # noqa: E402


def percentile(values: list[float], share: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(share * len(values)))] if values else None


def client_loop(url: str, prompts: list[str], deadline: float, seed: int, leave: float, out: dict) -> None:
    """Requests one after another until ``deadline``: random prompt and max_tokens, gone after the first token with
    probability ``leave``."""
    rng = random.Random(seed)
    client = connect(url)
    while time.monotonic() < deadline:
        began, last, left = time.perf_counter(), None, rng.random() < leave
        try:
            stream = client.chat.completions.create(
                model=client.served,
                messages=[{"role": "user", "content": rng.choice(prompts)}],
                max_tokens=rng.randint(4, 64),
                temperature=0,
                stream=True,
            )
            for chunk in stream:
                if not (chunk.choices and chunk.choices[0].delta.content):
                    continue
                now = time.perf_counter()
                if last is None:
                    out["ttft"].append(now - began)
                else:
                    out["itl"].append(now - last)
                last = now
                if left:
                    stream.close()
                    out["disconnects"] += 1
                    break
            out["requests"] += 1
        except Exception as error:  # counted, and the client goes on
            out["errors"].append(f"{type(error).__name__}: {error}"[:200])


def main() -> None:
    import psutil

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--leave", type=float, default=0.2, help="share of requests whose client goes away")
    parser.add_argument("--tag", default="smollm2-half-offloaded")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("server_args", nargs="*", default=DEFAULT_ARGS + ["serve.max_queue=64"])
    args = parser.parse_args()
    prompts = [line.strip() for line in (HERE / "prompts.txt").read_text().splitlines() if line.strip()]
    out = {"requests": 0, "disconnects": 0, "errors": [], "ttft": [], "itl": []}
    memory: list[tuple[float, int]] = []
    with tempfile.TemporaryDirectory() as scratch:
        proc, url = start(args.server_args, Path(scratch) / "run")
        server = psutil.Process(proc.pid)
        try:
            began = time.monotonic()
            deadline = began + 60 * args.minutes
            threads = [
                threading.Thread(target=client_loop, args=(url, prompts, deadline, seed, args.leave, out))
                for seed in range(args.clients)
            ]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                memory.append((time.monotonic() - began, server.memory_info().rss))
                time.sleep(5)
            figures = metrics(url)
        finally:
            proc.terminate()
            proc.wait(timeout=180)
    third = max(len(memory) // 3, 1)
    result = {
        "tag": args.tag,
        "server_args": args.server_args,
        "clients": args.clients,
        "minutes": args.minutes,
        "requests": out["requests"],
        "disconnects": out["disconnects"],
        "errors": len(out["errors"]),
        "first_errors": out["errors"][:5],
        "ttft_p50_s": statistics.median(out["ttft"]) if out["ttft"] else None,
        "ttft_p95_s": percentile(out["ttft"], 0.95),
        "itl_p50_s": statistics.median(out["itl"]) if out["itl"] else None,
        "itl_p95_s": percentile(out["itl"], 0.95),
        "generated_tokens": figures.get("offload_core_serve_generated_tokens_total"),
        "rss_first_third_mean_bytes": statistics.mean(m for _, m in memory[:third]),
        "rss_last_third_mean_bytes": statistics.mean(m for _, m in memory[-third:]),
        "rss_max_bytes": max(m for _, m in memory),
        "rss_over_time": memory,
        "server_exit_code": proc.returncode,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"serve-soak-{args.tag}.json").write_text(json.dumps(result, indent=1))
    mib = 2**20
    lines = [
        f"# Serve soak: {args.tag}",
        "",
        f"{args.clients} clients for {args.minutes:g} min (random prompt, 4-64 greedy tokens, {args.leave:.0%} go away "
        f"after their first token); `python run.py mode=serve {' '.join(args.server_args)}`",
        "",
        f"- requests {result['requests']}, of which {result['disconnects']} went away; errors: {result['errors']}",
        f"- time to first token p50 {result['ttft_p50_s']:.2f} s, p95 {result['ttft_p95_s']:.2f} s",
        f"- inter-token latency p50 {result['itl_p50_s']:.3f} s, p95 {result['itl_p95_s']:.3f} s",
        f"- server RSS: first third {result['rss_first_third_mean_bytes'] / mib:.0f} MiB, last third "
        f"{result['rss_last_third_mean_bytes'] / mib:.0f} MiB, max {result['rss_max_bytes'] / mib:.0f} MiB",
        f"- server exit code after SIGTERM: {result['server_exit_code']}",
    ]
    (Path(args.out) / f"serve-soak-{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
