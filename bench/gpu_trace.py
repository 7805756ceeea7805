"""One warm decoding step under torch.profiler: where a token's time goes on the GPU and on the host.

Loads a synthetic preset through the runner's own steps (default: the dense 3.4b, ``max_memory.0=1.5GB``, the rest
pinned in host memory, prefetch), decodes a few tokens to warm it, then times decoding steps (host wall clock and
CUDA events, the host time inside our module hooks per layer) and profiles one more step with CPU and CUDA
activities. Writes to ``--out``: ``gpu-trace-<tag>.json.gz`` (the Chrome trace of that step, for chrome://tracing
or Perfetto), ``.json`` (the figures) and ``.md`` (the summary: per-token wall time, GPU busy time, GPU idle gaps,
hook time per layer, copy-stream busy time).

    python bench/gpu_trace.py                                   # on the GPU: 3.4b, 1.5GB on GPU 0
    python bench/gpu_trace.py --preset tiny --device cpu --out /tmp/trace
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: a Chrome trace larger than this is refused by the report (the step's CPU operators are what makes it large)
TRACE_LIMIT = 10 * 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="3.4b", help="synthetic model size: tiny, small, 0.3b, 1.1b, 3.4b")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--budget",
        default=None,
        help="max_memory of the execution device (default: 1.5GB on cuda; on a cpu 1GB, or a "
        "quarter of a smaller checkpoint)",
    )
    parser.add_argument("--policy", default="prefetch", help="hook=<policy> (default prefetch)")
    parser.add_argument("--store", default=None, help="storage=<store> (default: pinned_cpu on cuda, safetensors)")
    parser.add_argument("--warm", type=int, default=3, help="decoding steps before anything is timed")
    parser.add_argument("--steps", type=int, default=5, help="decoding steps timed without the profiler")
    parser.add_argument("--tag", default=None, help="file suffix (default: <preset>-<device>)")
    parser.add_argument("--out", default=str(HERE / "results"))
    return parser.parse_args(argv)


# -- our hooks, timed ------------------------------------------------------------------------------


class HookClock:
    """Wraps every module hook's ``pre_forward`` / ``post_forward`` on the model: host seconds spent in them per
    module, and a ``offload_core::hook`` range in the profiler's trace."""

    def __init__(self, model) -> None:
        import torch

        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        names = {id(m): n or "<root>" for n, m in model.named_modules()}
        for module in model.modules():
            for hook in module.__dict__.get("_offload_module_hooks", ()):
                for method in ("pre_forward", "post_forward"):
                    setattr(hook, method, self._timed(getattr(hook, method), names[id(module)], torch))

    def _timed(self, method, name: str, torch):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            with torch.profiler.record_function("offload_core::hook"):
                result = method(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - started
            self.calls[name] += 1
            return result

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


# -- the Chrome trace, read back -------------------------------------------------------------------


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _busy(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in _union(intervals))


def _gaps(intervals: list[tuple[float, float]], start: float, end: float) -> list[float]:
    """Idle stretches between ``start`` and ``end`` outside the union of ``intervals`` (microseconds)."""
    gaps, at = [], start
    for a, b in _union(intervals):
        if a > at:
            gaps.append(a - at)
        at = max(at, b)
    if end > at:
        gaps.append(end - at)
    return gaps


def trace_figures(events: list[dict]) -> dict:
    """The step's figures from a Chrome trace's events: the ``offload_core::decode_step`` range is the step."""
    step = [e for e in events if e.get("name") == "offload_core::decode_step" and e.get("ph") == "X"]
    if not step:
        raise SystemExit("gpu_trace: the profiled step is not in the trace")
    begin = min(float(e["ts"]) for e in step)
    end = max(float(e["ts"]) + float(e.get("dur", 0)) for e in step)
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu = [e for e in gpu if begin <= float(e["ts"]) <= end]
    span = lambda e: (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))  # noqa: E731
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    streams: dict = defaultdict(int)
    for e in kernels:
        streams[e.get("args", {}).get("stream")] += 1
    compute = max(streams, key=streams.get) if streams else None  # the stream that runs most kernels
    h2d = [e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    copy_streams = sorted({e.get("args", {}).get("stream") for e in h2d} - {compute}, key=str)
    hooks = [e for e in events if e.get("name") == "offload_core::hook" and begin <= float(e["ts"]) <= end]
    compute_spans = [span(e) for e in kernels if e.get("args", {}).get("stream") == compute]
    compute_gaps = _gaps(compute_spans, begin, end)
    any_gaps = _gaps([span(e) for e in gpu], begin, end)
    ms = 1e-3
    return {
        "step_ms": (end - begin) * ms,
        "gpu_busy_ms": _busy([span(e) for e in gpu]) * ms,
        "gpu_idle_ms": sum(any_gaps) * ms,
        "gpu_largest_gap_ms": max(any_gaps, default=0.0) * ms,
        "compute_stream": compute,
        "compute_busy_ms": _busy(compute_spans) * ms,
        "compute_idle_ms": sum(compute_gaps) * ms,
        "compute_largest_gap_ms": max(compute_gaps, default=0.0) * ms,
        "compute_gaps_over_50us": sum(1 for g in compute_gaps if g > 50),
        "kernels": len(kernels),
        "copy_streams": copy_streams,
        "h2d_copies": len(h2d),
        "h2d_bytes": sum(int(e.get("args", {}).get("bytes", 0) or 0) for e in h2d),
        "copy_stream_busy_ms": _busy([span(e) for e in h2d if e.get("args", {}).get("stream") != compute]) * ms,
        "h2d_on_compute_stream_ms": _busy([span(e) for e in h2d if e.get("args", {}).get("stream") == compute]) * ms,
        "hook_host_ms_in_trace": sum(float(e.get("dur", 0)) for e in hooks) * ms,
    }


# -- the run ---------------------------------------------------------------------------------------


def load(args):
    """The model through the runner's own steps (bench/worker.py), and its checkpoint's size."""
    import worker
    from offload_core.loading import sources
    from offload_core.loading.checkpoint import Checkpoint

    print(f"building (or finding) the synthetic {args.preset} checkpoint ...", flush=True)
    path = sources.synthetic_checkpoint(**sources.synthetic_preset(args.preset))
    with Checkpoint.open(path) as ckpt:
        total = ckpt.total_bytes()
    args.budget = args.budget or ("1.5GB" if args.device == "cuda" else str(min(10**9, total // 4)))
    spec = {
        "kind": "ours",
        "policy": args.policy,
        "store": args.store,
        "preset": args.preset,
        "checkpoint": str(path),
        "dtype": "bfloat16",
        "budget": args.budget,
        "cpu_budget": 2 * total,
        "tokens": args.warm + args.steps + 1,
        "cold": False,
        "prompt": "The quick brown fox jumps over the lazy dog.",
        "device": args.device,
        "scratch": tempfile.mkdtemp(prefix="offload-trace-"),
        "overrides": [],
    }
    cfg, overrides = worker.prepare_ours(spec)
    model, info = worker.load_ours(spec, cfg)
    ids = worker.prompt_ids(spec["prompt"], model.config.vocab_size).to(worker.execution_device(spec))
    return model, info, ids, total, overrides


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    args.store = args.store or ("pinned_cpu" if cuda else "safetensors")
    tag = args.tag or f"{args.preset}-{args.device}"
    import torch
    from transformers import DynamicCache

    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_trace: --device cuda needs a CUDA device (use --device cpu here)")
    started = time.perf_counter()
    model, info, ids, total, overrides = load(args)
    load_s = time.perf_counter() - started
    clock = HookClock(model)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

        def step():
            nonlocal token
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

        for _ in range(args.warm):
            step()
        sync()
        walls, events_ms, hooks = [], [], []
        stats = model.offload_state.stats
        before = stats.snapshot()["bytes"]
        for _ in range(args.steps):
            clock.reset()
            if cuda:
                first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                first.record()
            began = time.perf_counter()
            step()
            if cuda:
                last.record()
            sync()
            walls.append(time.perf_counter() - began)
            if cuda:
                events_ms.append(first.elapsed_time(last))
            hooks.append(dict(clock.seconds))
        moved = (stats.snapshot()["bytes"] - before) / args.steps
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        clock.reset()
        with torch.profiler.profile(activities=activities) as profiler:
            with torch.profiler.record_function("offload_core::decode_step"):
                step()
                sync()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu-trace-{tag}"
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "trace.json"
        profiler.export_chrome_trace(str(raw))
        text = raw.read_text()
    events = json.loads(text).get("traceEvents", [])
    figures = trace_figures(events)
    if not cuda:  # no device activity to read: the GPU figures say n/a rather than a CPU run's "idle"
        figures = {k: v if k in ("step_ms", "hook_host_ms_in_trace") else None for k, v in figures.items()}
    trace_path = Path(f"{stem}.json.gz")
    with gzip.open(trace_path, "wt", compresslevel=6) as f:
        f.write(text)
    trace_bytes = trace_path.stat().st_size
    if trace_bytes > TRACE_LIMIT:
        print(f"gpu_trace: warning: the trace is {trace_bytes / 2**20:.1f} MiB (over 10 MiB)", flush=True)
    per_layer = defaultdict(list)
    for seconds in hooks:
        for name, s in seconds.items():
            per_layer[name].append(s * 1e3)
    layer_ms = {name: statistics.median(v) for name, v in per_layer.items()}
    h2d = None
    if cuda:
        from gpu import pinned_h2d_bandwidth

        h2d = pinned_h2d_bandwidth()
    result = {
        "command": "python bench/gpu_trace.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "checkpoint_bytes": total,
        "offloaded_bytes": info["offloaded_bytes"],
        "overrides": overrides,
        "cpus": os.cpu_count(),
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "load_s": load_s,
        "steps": args.steps,
        "step_wall_ms": [w * 1e3 for w in walls],
        "step_wall_ms_median": statistics.median(walls) * 1e3,
        "step_cuda_event_ms": events_ms,
        "step_cuda_event_ms_median": statistics.median(events_ms) if events_ms else None,
        "hook_host_ms_per_step_median": statistics.median(sum(h.values()) * 1e3 for h in hooks),
        "hook_host_ms_per_layer": layer_ms,
        "bytes_moved_per_step": moved,
        "pinned_h2d_bytes_per_s": h2d,
        "transfer_bound_ms": moved / h2d * 1e3 if h2d else None,
        "counters": model.offload_state.handle.counters() if hasattr(model.offload_state.handle, "counters") else {},
        "profiled": figures,
        "trace_file": trace_path.name,
        "trace_bytes": trace_bytes,
    }
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    Path(f"{stem}.md").write_text(markdown(result))
    info["_release"].close()
    print(Path(f"{stem}.md").read_text())
    print(f"wrote {stem}.json, .md and {trace_path.name} ({trace_bytes / 2**20:.2f} MiB)", flush=True)


def _f(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(r: dict) -> str:
    p = r["profiled"]
    layers = r["hook_host_ms_per_layer"]
    per_layer = [v for k, v in layers.items() if k != "<root>"]
    lines = [
        f"# One warm decoding step, profiled: synthetic {r['preset']} on {r['device']}",
        "",
        f"`{r['command']}`",
        "",
        f"torch {r['torch']}, {r['cpus']} CPUs, load average {r['loadavg']}; {', '.join(r['overrides'])}. "
        f"Checkpoint {r['checkpoint_bytes'] / 1e9:.2f} GB, offloaded {r['offloaded_bytes'] / 1e9:.2f} GB; "
        f"{r['steps']} steps timed without the profiler (medians), one step profiled (trace: `{r['trace_file']}`, "
        f"{r['trace_bytes'] / 2**20:.2f} MiB, open in chrome://tracing or ui.perfetto.dev).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| step wall time, host (synchronized), ms | {_f(r['step_wall_ms_median'])} |",
        f"| step time between CUDA events, ms | {_f(r['step_cuda_event_ms_median'])} |",
        f"| bytes moved per step, GB | {r['bytes_moved_per_step'] / 1e9:.3f} |",
        f"| transfer bound (bytes / pinned H2D bandwidth), ms | {_f(r['transfer_bound_ms'])} |",
        f"| host time in our hooks per step, ms | {_f(r['hook_host_ms_per_step_median'], 3)} |",
        f"| host time in our hooks per layer (median of {len(per_layer)} hooked units), ms | "
        f"{_f(statistics.median(per_layer) if per_layer else None, 3)} |",
        f"| profiled step, ms | {_f(p['step_ms'])} |",
        f"| GPU busy (any stream), ms | {_f(p['gpu_busy_ms'])} |",
        f"| GPU idle (no stream busy): sum / largest gap, ms | {_f(p['gpu_idle_ms'])} / "
        f"{_f(p['gpu_largest_gap_ms'])} |",
        f"| compute stream busy ({p['kernels']} kernels), ms | {_f(p['compute_busy_ms'])} |",
        f"| compute stream idle: sum / largest gap / gaps over 50 us | {_f(p['compute_idle_ms'])} ms / "
        f"{_f(p['compute_largest_gap_ms'])} ms / {p['compute_gaps_over_50us']} |",
        f"| copy stream busy ({p['h2d_copies']} H2D copies, {_f(p['h2d_bytes'] and p['h2d_bytes'] / 1e9, 3)} GB), ms "
        f"| {_f(p['copy_stream_busy_ms'])} |",
        f"| H2D copies on the compute stream, ms | {_f(p['h2d_on_compute_stream_ms'])} |",
        f"| host time in our hooks inside the profiled step, ms | {_f(p['hook_host_ms_in_trace'], 3)} |",
        "",
        "Host time in our module hooks per hooked module (pre + post forward, median over the timed steps, ms):",
        "",
        "| module | ms |",
        "|---|---|",
        *(f"| {name} | {ms:.3f} |" for name, ms in layers.items()),
        "",
        f"Counters: `{json.dumps(r['counters'], default=str)}`",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
