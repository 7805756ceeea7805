"""Stress of the mapped paths: tensors that view mapped memory (offload folder files, safetensors shards read in place,
fused experts spliced from a shard's pages, reserved expert rows) read by threads while other threads drop their pages,
close their stores and checkpoints, try to close the mappings under them and collect what is let go; under memory
pressure (a child process that takes and gives back memory, every file's page cache dropped as it runs), for minutes.

The rule under test is :mod:`offload_core.storage.mapping`'s: no mapping is unmapped while a tensor views it. Every
read is compared with the bytes written; a crash (a mapping unmapped under a view: SIGSEGV; a file cut under it:
SIGBUS) ends the child, whose exit status the report gives. ``--raw`` makes the views as offload_core made them before
the rule (``torch.frombuffer``: a reference to the mapping but no buffer export), so that closing a mapping unmaps it
under its views: the same run then crashes.

    python bench/stress_mapped.py                          # 300 s: the stores' paths and model runs, with pressure
    python bench/stress_mapped.py --seconds 60 --no-models --pressure 0
    python bench/stress_mapped.py --seconds 3 --no-models --raw --out /tmp/raw.json   # crashes (-11)

Writes ``bench/results/stress-mapped.json`` and ``.md`` (``--out`` for another JSON path; its ``.md`` beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def pressure_child(mib: int, seconds: float) -> subprocess.Popen | None:
    """A process that takes ``mib`` MiB, touches every page, gives it back and starts again (page cache is what
    the kernel reclaims to make room)."""
    if mib <= 0:
        return None
    code = (
        "import mmap, time\n"
        f"end = time.time() + {seconds}\n"
        "while time.time() < end:\n"
        f"    m = mmap.mmap(-1, {mib} << 20)\n"
        f"    for i in range(0, {mib} << 20, 4096): m[i] = 1\n"
        "    time.sleep(0.2)\n"
        "    m.close()\n"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0, help="how long the stress runs (default 300)")
    parser.add_argument("--no-models", action="store_true", help="only the stores' paths (no model runs)")
    parser.add_argument("--raw", action="store_true", help="views without the rule (torch.frombuffer): crashes")
    parser.add_argument(
        "--pressure",
        type=int,
        default=-1,
        help="MiB the pressure child cycles (default: a quarter of the available memory, at most 4096; 0: none)",
    )
    parser.add_argument("--readers", type=int, default=2, help="reader threads (default 2)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "stress-mapped.json")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        sys.path.insert(0, str(HERE))  # the child's modules beside this script
        from stress_paths import run_child

        return run_child(args.root, args.child, args.seconds, not args.no_models, args.raw, args.readers)
    pressure = args.pressure
    if pressure < 0:
        import psutil

        pressure = min(4096, int(psutil.virtual_memory().available >> 20) // 4)
    counts = args.out.with_suffix(".counts.json")
    counts.unlink(missing_ok=True)
    started = time.time()
    load_before = os.getloadavg()[0]
    hog = pressure_child(pressure, args.seconds + 60)
    root = Path(tempfile.mkdtemp(prefix="stress-mapped-"))  # removed here: a crashed child cannot
    child = [
        sys.executable,
        "-X",
        "faulthandler",
        str(Path(__file__).resolve()),
        "--child",
        str(counts),
        "--root",
        str(root),
        "--seconds",
        str(args.seconds),
    ]
    child += (
        ["--readers", str(args.readers)] + (["--no-models"] if args.no_models else []) + (["--raw"] if args.raw else [])
    )
    try:
        done = subprocess.run(child, capture_output=True, text=True, timeout=args.seconds + 600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if hog is not None:
            hog.kill()
            hog.wait()
    counted = json.loads(counts.read_text()) if counts.exists() else {}
    counts.unlink(missing_ok=True)
    report = {
        "command": " ".join(["python", "bench/stress_mapped.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": _commit(),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "seconds": round(time.time() - started, 1),
        "raw": args.raw,
        "models": not args.no_models,
        "pressure_mib": pressure,
        "returncode": done.returncode,
        "crashed": done.returncode < 0,
        "counts": counted,
        "stderr_tail": _crash_dump(done.stderr),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(_markdown(report))
    print(_markdown(report))
    return 0 if done.returncode == 0 else 1


def _crash_dump(stderr: str) -> str:
    """The crash's own lines where the child crashed (faulthandler's dump, its faulting thread first), else the end."""
    start = stderr.find("Fatal Python error")
    return stderr[start : start + 4000] if start >= 0 else stderr[-3000:]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _markdown(report: dict) -> str:
    counts = report["counts"]
    status = report["returncode"]
    verdict = (
        f"crashed (signal {-status})"
        if status < 0
        else "no crash, every read equal"
        if status == 0
        else f"failed ({status})"
    )
    lines = [
        "# Mapped paths under stress",
        "",
        f"`{report['command']}` at commit {report['commit']} on {report['machine']}, load average "
        f"{report['load_average'][0]} before and {report['load_average'][1]} after, {report['seconds']} s, "
        f"pressure child {report['pressure_mib']} MiB, views {'without' if report['raw'] else 'under'} the rule: "
        f"**{verdict}**.",
        "",
        "| what | count |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in sorted(counts.items())),
        "",
    ]
    if status != 0:
        lines += ["```", report["stderr_tail"].strip()[:2000], "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
