"""The markdown report of ``bench/serve_peers.py``'s result: the summary per client count, the target, the agreement
of the two systems' texts and every session's figures."""

from __future__ import annotations

OURS, PEER = "offload_core serve", "transformers serve"


def report(result: dict) -> str:
    """The markdown report of a result dict."""

    def f(value, digits=2):
        return "–" if value is None else f"{value:.{digits}f}"

    def mib(value):
        return "–" if value is None else f"{value / 2**20:.1f} MiB"

    sessions, summary = result["sessions"], result["summary"]
    peer = next(s for s in sessions if s["system"] == PEER)
    ours = next(s for s in sessions if s["system"] == OURS)
    cold = (
        f"Cold: both asked to read every offloaded byte from disk each pass (ours `page_cache=0`; "
        f"`{peer.get('cold')}`); the disk-read columns say what each server's processes read from the block device "
        "while answering (page-cache hits not counted)."
    )
    lines = [
        f"# Serve against transformers serve: {result['tag']}",
        "",
        f"Both systems serve `{result['model']}` at `max_memory.cpu={result['budget']}`"
        + (f" (the peer's device map at {result['peer_budget']})" if result.get("peer_budget") else "")
        + f", {result['tokens']} greedy "
        f"streamed tokens per request, one request per client, {result['rounds']} round(s), the systems started in "
        f"turn and alternated from round to round; machine: {result['machine']}. Load average "
        f"{result['loadavg_start']:.2f} at start, {result['loadavg_end']:.2f} at end: the machine was busy with other "
        "work, so read the ratios, not the absolute figures.",
        "",
        f"- ours: `{ours['command']}`",
        f"- peer: `{peer['command']}` (continuous batching asked: {result['batching']}, used: "
        f"{peer['continuous_batching_used']}; {peer['placement']}; files written to the offload folder: "
        f"{peer['offload_folder_files']})",
        "",
        *(
            [f"The peer's continuous batching failed, so it ran without: `{result['batching_error'][-300:]}`", ""]
            if result["batching_error"]
            else []
        ),
        *([result["note"], ""] if result.get("note") else []),
        *([cold, ""] if result.get("cold") else []),
        "Command: `" + result["command"] + "`",
        "",
        "| clients | ours tok/s | peer tok/s | ours / peer | ours TTFT p50 s | peer TTFT p50 s | "
        "ours bytes moved/token | disk read/token ours | peer | CPU s/token ours | peer |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        tps, ttft = row["aggregate_tokens_per_s"], row["ttft_p50_s"]
        disk, cpu = row.get("disk_read_per_token") or {}, row.get("cpu_s_per_token") or {}
        lines.append(
            f"| {row['clients']} | {f(tps['ours'])} | {f(tps['peer'])} | {f(tps['ratio'])}x | {f(ttft['ours'])} | "
            f"{f(ttft['peer'])} | {mib(row['bytes_moved_per_token'])} | {mib(disk.get('ours'))} | "
            f"{mib(disk.get('peer'))} | {f(cpu.get('ours'), 3)} | {f(cpu.get('peer'), 3)} |"
        )
    target = result["target"]
    lines += [
        "",
        f"Target (>= 3x at 8 clients, ahead at 1 client): 8 clients {f(target['ratio_8'])}x "
        f"({'met' if target['met_8'] else 'not met'}), 1 client {f(target['ratio_1'])}x "
        f"({'met' if target['met_1'] else 'not met'}).",
        "",
        f"Same greedy text for `{result['agreement']['prompt']}` alone: {result['agreement']['same']}. Requests with "
        "the same text from both, of those answered (first round, client i sends prompt i): "
        + ", ".join(f"{n}/{of} at {c} clients" for c, (n, of) in result["agreement"]["by_clients"].items())
        + ".",
        "",
        "Every session (medians above are over these):",
        "",
        "| round | system | ready s | first request s | peak RSS MiB | clients | tok/s | TTFT p50 s | load avg | "
        "failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sessions:
        for row in s["loads"]:
            lines.append(
                f"| {s['round']} | {s['system']} | {f(s['ready_s'], 1)} | {f(s['first_request_s'], 1)} | "
                f"{f((s.get('peak_rss_bytes') or 0) / 2**20 or None, 0)} | "
                f"{row['clients']} | {f(row['aggregate_tokens_per_s'])} | {f(row['ttft_p50_s'])} | "
                f"{f(row['loadavg'])} | {len(row['failed'])} |"
            )
    return "\n".join(lines) + "\n"
