"""Our server against ``transformers serve`` (continuous batching on, its model loaded by an accelerate device map
at the same CPU budget, the rest on disk): aggregate generated tokens/s and time to first token at 1, 4 and 8 clients.

In one invocation, for each round, starts in turn ``python run.py mode=serve`` as ``bench/serve.py`` starts it and
``transformers serve`` through ``bench/hf_serve_offloaded.py`` on the same model folder, drives each with the same
greedy streaming ``openai`` clients (``bench/serve.py``'s), stops it, and alternates the order from round to round.
Writes ``bench/results/serve-peers-<tag>.json`` and ``.md``::

    python bench/serve_peers.py --clients 1,4,8 --tokens 32 --rounds 2
``--cold``: both read every offloaded byte from the disk on every pass, ours with ``page_cache=0`` (each block's
pages dropped after it runs), the peer through ``hf_serve_offloaded.py --cold`` (each disk-offloaded module's weight
bytes dropped from the page cache after its forward): the comparison where moving bytes, not compute, is the bound.
``--peer-budget``: the peer's CPU budget, where accelerate's (weights only) should leave on disk the bytes ours does
(ours holds the KV cache and activations inside its budget: at SmolLM2's 500MiB the peer puts 27 MiB on disk, ours
283.6 MiB; at 245MiB the peer puts the same 283.6 MiB); the report gives each one's bytes on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402  (bench/serve.py: how our server is started, asked and measured)
from serve_peers_report import OURS, PEER, report  # noqa: E402

HERE, ROOT = serve.HERE, serve.ROOT


def budget_of(server_args: list[str]) -> str:
    """The CPU budget our server is given (``max_memory.cpu=...``), handed to the peer unchanged."""
    found = key_of(server_args, "max_memory.cpu")
    if not found:
        raise SystemExit("serve_peers: the server arguments need max_memory.cpu=<size>, the budget both systems get")
    return found


def peer_folder(model: Path, into: Path) -> Path:
    """``model``'s files linked into ``into``, its config given ``architectures`` where it has none.

    transformers serve picks the model class from ``config.architectures[0]``; our converted SmolLM2 config has
    no such field (``from_pretrained`` of a named class does not need it). The weights are the same files.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    into.mkdir(parents=True)
    for f in model.iterdir():
        if f.name != "config.json":
            (into / f.name).symlink_to(f.resolve())
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = config.get("architectures") or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    (into / "config.json").write_text(json.dumps(config, indent=1))
    return into


def key_of(server_args: list[str], key: str) -> str | None:
    found = [a.split("=", 1)[1] for a in server_args if a.startswith(f"{key}=")]
    return found[-1] if found else None


def kv_blocks(server_args: list[str], clients: int, page: int = 256) -> int:
    """The peer's KV cache in blocks of ``page`` tokens (transformers' default page size): the tokens our server
    plans, ``serve.context`` (default 1024) x ``serve.max_batch`` (where it is ``auto`` or unset: the most clients
    sent at once). Left alone, transformers sizes it from the device's free memory, which on a CPU is most of the
    host's RAM (14 GB on a 24 GiB machine, allocated at the first request, whatever the model)."""
    context, batch = key_of(server_args, "serve.context") or "1024", key_of(server_args, "serve.max_batch")
    slots = int(batch) if batch and batch.isdigit() else clients
    return -(-int(context) * slots // page)


def peak_rss(pid: int) -> int | None:
    """The process's peak resident memory in bytes (Linux), or None."""
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def peer_command(
    folder: Path, budget: str, offload: Path, port: int, batching: bool, blocks: int | None, cold: bool = False
) -> list[str]:
    cb = ["--continuous-batching"] if batching else []
    cb += ["--cb-num-blocks", str(blocks)] if batching and blocks else []
    wrapper = ["--max-memory-cpu", budget, "--offload-folder", str(offload), *(["--cold"] if cold else [])]
    serve_args = [*cb, "--host", "127.0.0.1", "--port", str(port), "--log-level", "info", str(folder)]
    return [sys.executable, str(HERE / "hf_serve_offloaded.py"), *wrapper, "--", "serve", *serve_args]


def start_peer(command: list[str], log: Path, timeout: float = 900) -> tuple[subprocess.Popen, str]:
    """The peer's process and URL once ``/health`` answers (it loads the model before it listens)."""
    url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("transformers serve exited:\n" + log.read_text()[-3000:])
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5)
            return proc, url
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError("transformers serve did not answer /health in time")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def used(pid: int) -> tuple[int, float]:
    """What the process and its children used so far: bytes read from the block device (page-cache hits not
    counted) and CPU seconds (user + system)."""
    import psutil

    root = psutil.Process(pid)
    read, cpu = 0, 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            read, cpu = read + proc.io_counters().read_bytes, cpu + times.user + times.system
        except psutil.Error:  # a child that ended between the listing and the reading
            pass
    return read, cpu


def drive(url: str, prompts: list[str], clients: int, tokens: int, ours: bool, pid: int) -> dict:
    """``clients`` threads, one greedy streamed request each; tokens counted from the responses' usage, the disk
    read by the server's processes while they answered."""
    client = serve.connect(url)
    before = serve.metrics(url) if ours else {}
    used_before = used(pid)
    results: dict[int, dict] = {}
    failed: list[str] = []

    def worker(c: int) -> None:
        try:
            results[c] = serve.ask(client, prompts[c % len(prompts)], tokens)
        except Exception as error:  # noqa: BLE001 (a failed request is a figure of the run, not its end)
            failed.append(f"{type(error).__name__}: {error}"[:300])

    began = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    (read, cpu), (read_before, cpu_before) = used(pid), used_before
    generated = sum(r["tokens"] for r in results.values())
    ttft = [r["ttft_s"] for r in results.values() if r["ttft_s"] is not None]
    row = {
        "clients": clients,
        "generated_tokens": generated,
        "seconds": wall,
        "aggregate_tokens_per_s": generated / wall,
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "failed": failed,
        "texts": {c: r["text"] for c, r in sorted(results.items())},
        "loadavg": os.getloadavg()[0],
        "disk_read_per_token": (read - read_before) / generated if generated else None,
        "cpu_s_per_token": (cpu - cpu_before) / generated if generated else None,
    }
    if ours:
        moved = serve.metrics(url)["offload_core_serve_bytes_moved"] - before["offload_core_serve_bytes_moved"]
        row["bytes_moved_per_token"] = moved / generated if generated else None
    return row


def session(system: str, args, folder: Path, scratch: Path, prompts: list[str], loads: list[int]) -> dict:
    """Start ``system``, warm it up (first request timed), run every load, stop it."""
    began = time.perf_counter()
    if system == OURS:
        ours = [*args.server_args, *(["page_cache=0"] if args.cold else [])]
        proc, url = serve.start(ours, scratch / f"run-{time.monotonic_ns()}")
        detail = {"command": "python run.py mode=serve " + " ".join(ours)}
    else:
        offload = Path(tempfile.mkdtemp(dir=scratch, prefix="offload-"))
        blocks = kv_blocks(args.server_args, max(int(c) for c in args.clients.split(",")))
        budget = args.peer_budget or budget_of(args.server_args)
        command = peer_command(folder, budget, offload, free_port(), args.batching, blocks, args.cold)
        log = scratch / f"peer-{time.monotonic_ns()}.log"
        proc, url = start_peer(command, log)
        shown = ["python", "bench/hf_serve_offloaded.py", *command[2:]]
        detail = {"command": " ".join(shown), "log": log}
    try:
        ready = time.perf_counter() - began
        first = time.perf_counter()
        serve.ask(serve.connect(url), prompts[0], 4)
        rows = [drive(url, prompts, clients, args.tokens, system == OURS, proc.pid) for clients in loads]
        warm = time.perf_counter() - first - sum(r["seconds"] for r in rows)
        detail["peak_rss_bytes"] = peak_rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    if system == PEER:
        text = detail.pop("log").read_text()
        detail["continuous_batching_used"] = "CB: True" in text
        placed = re.search(r"^hf_serve_offloaded: .*device map.*$", text, re.M)
        detail["placement"] = placed.group(0) if placed else None
        cold = re.search(r"^hf_serve_offloaded: cold.*$", text, re.M)
        detail["cold"] = cold.group(0) if cold else None
        detail["offload_folder_files"] = sum(1 for _ in offload.iterdir())
    return {"system": system, "ready_s": ready, "first_request_s": warm, "loads": rows, **detail}


def summarize(sessions: list[dict], loads: list[int]) -> list[dict]:
    """Per client count: each system's median over rounds and ours over the peer's."""
    out = []
    for i, clients in enumerate(loads):

        def med(system, key, i=i):
            values = [s["loads"][i][key] for s in sessions if s["system"] == system and s["loads"][i][key] is not None]
            return statistics.median(values) if values else None

        row = {"clients": clients}
        for key in ("aggregate_tokens_per_s", "ttft_p50_s"):
            ours, peer = med(OURS, key), med(PEER, key)
            row[key] = {"ours": ours, "peer": peer, "ratio": ours / peer if ours and peer else None}
        row["bytes_moved_per_token"] = med(OURS, "bytes_moved_per_token")
        for key in ("disk_read_per_token", "cpu_s_per_token"):
            row[key] = {"ours": med(OURS, key), "peer": med(PEER, key)}
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", help="model folder both serve (default: the converted SmolLM2 checkpoint)")
    parser.add_argument(
        "--no-batching", dest="batching", action="store_false", help="peer without --continuous-batching"
    )
    parser.add_argument("--cold", action="store_true", help="both read the offloaded weights from disk every pass")
    parser.add_argument(
        "--peer-budget", help="the peer's max_memory cpu (default: ours; accelerate's holds weights only)"
    )
    parser.add_argument("--tag", default="smollm2")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("server_args", nargs="*", help="run.py keys (default: %(default)s)", default=serve.DEFAULT_ARGS)
    args = parser.parse_args()
    if args.model is None:
        from offload_core.loading.sources import smollm2_checkpoint

        args.model = str(smollm2_checkpoint())
    if not any(a.startswith("model") for a in args.server_args):
        args.server_args = ["model=local", f"model.path={args.model}", *args.server_args]
    prompts = [line.strip() for line in (HERE / "prompts.txt").read_text().splitlines() if line.strip()]
    loads = [int(c) for c in args.clients.split(",")]
    loadavg_start = os.getloadavg()[0]
    sessions, batching_error = [], None
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        folder = peer_folder(Path(args.model), scratch / "model")
        for r in range(args.rounds):
            for system in (OURS, PEER) if r % 2 == 0 else (PEER, OURS):
                try:
                    s = session(system, args, folder, scratch, prompts, loads)
                except Exception as error:  # the peer's continuous batching could not run: without it, said so
                    if system != PEER or not args.batching:
                        raise
                    batching_error, args.batching = str(error)[-2000:], False
                    s = session(system, args, folder, scratch, prompts, loads)
                sessions.append({"round": r + 1, **s})
                print(f"round {r + 1}: {system} done", file=sys.stderr, flush=True)
                # written after every session once both systems ran: a run cut short keeps its figures
                if len({x["system"] for x in sessions}) == 2:
                    write(collect(args, sessions, prompts, loads, loadavg_start, batching_error))
    print(report(collect(args, sessions, prompts, loads, loadavg_start, batching_error)))


def agreement(sessions: list[dict], prompts: list[str]) -> dict:
    """The first prompt's greedy text from each system alone (1 client), and at every load how many requests got the
    same text from both (their first sessions; batched requests may differ where a system's batch rounds)."""
    first = {}
    for s in sessions:
        first.setdefault(s["system"], s)
    texts = {name: {int(c): t for c, t in s["loads"][0]["texts"].items()} for name, s in first.items()}
    alone = {name: t.get(0) for name, t in texts.items()} if sessions[0]["loads"][0]["clients"] == 1 else {}
    by_clients = {}
    for i, row in enumerate(sessions[0]["loads"]):
        ours, peer = ({int(c): t for c, t in first[n]["loads"][i]["texts"].items()} for n in (OURS, PEER))
        both = set(ours) & set(peer)
        by_clients[row["clients"]] = [sum(ours[c] == peer[c] for c in both), len(both)]
    same = len(alone) == 2 and len(set(alone.values())) == 1
    return {"prompt": prompts[0], "texts": alone, "same": same, "by_clients": by_clients}


def collect(args, sessions: list[dict], prompts: list[str], loads: list[int], loadavg_start: float, error) -> dict:
    """The result dict of the sessions run so far."""
    summary = summarize(sessions, loads)
    by = {row["clients"]: row["aggregate_tokens_per_s"]["ratio"] for row in summary}
    return {
        "tag": args.tag,
        "out": args.out,
        "command": "python bench/serve_peers.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "budget": budget_of(args.server_args),
        "peer_budget": args.peer_budget,
        "tokens": args.tokens,
        "rounds": max(s["round"] for s in sessions),
        "batching": args.batching,
        "cold": args.cold,
        "batching_error": error,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg()[0],
        "sessions": sessions,
        "summary": summary,
        "target": {
            "ratio_8": by.get(8),
            "met_8": (by.get(8) or 0) >= 3,
            "ratio_1": by.get(1),
            "met_1": (by.get(1) or 0) > 1,
        },
        "agreement": agreement(sessions, prompts),
    }


def write(result: dict) -> None:
    out = Path(result["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"serve-peers-{result['tag']}.json").write_text(json.dumps(result, indent=1))
    (out / f"serve-peers-{result['tag']}.md").write_text(report(result))


if __name__ == "__main__":
    main()
