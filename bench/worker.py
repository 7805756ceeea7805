"""One measurement of one system in a fresh process: import, record the RSS baseline, load, generate, write the figures
as JSON.

Run by ``bench/compare.py`` as ``python bench/worker.py '<spec json>' <out.json>``; never imported by
``offload_core``. Systems: ``inmem`` (transformers, all in RAM), ``accelerate`` (empty init +
``infer_auto_device_map`` + ``load_checkpoint_and_dispatch`` with an offload folder; transformers'
``from_pretrained`` with that device map where the checkpoint's names need converting) and ``ours``
(the runner's planning, then ``load_checkpoint_and_dispatch`` with a store and a policy, as ``run.py`` does).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList  # noqa: F401

from offload_core.jobs.metrics import MemoryMonitor, rss_split

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pagecache  # noqa: E402
from gpu import pinned_h2d_bandwidth  # noqa: E402
from peers import execution_device, load_accelerate, load_inmem, max_memory_of, on_gpu  # noqa: E402

#: the code being measured (a snapshot of HEAD made by compare.py, or this checkout)
REPO = Path(os.environ.get("BENCH_CODE_ROOT", Path(__file__).resolve().parent.parent))


def read_io_bytes() -> int:
    """Bytes this process (all threads) caused to be read from storage (``/proc/self/io`` read_bytes)."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


#: cold runs: how many times the disk's sequential bandwidth is measured (all but two before decoding)
BANDWIDTH_SAMPLES = 5


class Timer(StoppingCriteria):
    """Stamps each new token and the process's disk reads at it; in cold mode drops the offloaded files' pages before
    the next token. The time spent dropping is kept out of the stamps, so per-token times are the model's alone."""

    def __init__(self, cold_files: list[str] | None = None) -> None:
        self.cold_files = cold_files or []
        self.stamps: list[float] = []
        self.io: list[
            int
        ] = []  # /proc/self/io read_bytes at each stamp: decode tokens' disk reads, the prompt's left out
        self.excluded = 0.0
        self.cached_after_drop: list[float] = []
        self.start = time.perf_counter()
        self.stats = None  # our runs' transfer counters: the bytes moved by each stamp
        self.moved: list[int] = []

    def drop(self) -> None:
        started = time.perf_counter()
        pagecache.drop_cache(self.cold_files)
        self.cached_after_drop.append(pagecache.cached_fraction(self.cold_files))
        self.excluded += time.perf_counter() - started

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.is_cuda:
            torch.cuda.synchronize()  # the token is computed, not only queued
        self.stamps.append(time.perf_counter() - self.excluded)
        self.io.append(read_io_bytes())
        if self.stats is not None:
            self.moved.append(self.stats.snapshot()["bytes"])
        if self.cold_files:
            self.drop()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def prompt_ids(prompt: str, vocab_size: int, batch: int = 1) -> torch.Tensor:
    """``batch`` rows of the prompt's ids, each row's first id made distinct (equal lengths: no padding)."""
    from offload_core.runner.inputs import byte_ids

    ids = torch.tensor([byte_ids(prompt, vocab_size)], dtype=torch.long).repeat(batch, 1)
    ids[:, 0] = (ids[:, 0] + torch.arange(batch)) % (vocab_size - 1) + 1
    return ids


def generate(model, input_ids: torch.Tensor, tokens: int, cold_files: list[str], stats=None) -> tuple[list[int], Timer]:
    """Greedy decoding of exactly ``tokens`` new tokens (EOS suppressed), as the runner generates (``stats``: the
    transfer counters read at each token)."""
    timer = Timer(cold_files)
    timer.stats = stats
    if cold_files:
        timer.drop()
        timer.excluded = 0.0
    timer.start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([timer]),
            pad_token_id=model.config.eos_token_id,
        )
    return out[0, input_ids.shape[1] :].tolist(), timer


# -- the three systems -----------------------------------------------------------------------------


def prepare_ours(spec: dict):
    """Compose the run's config through Hydra exactly as ``run.py`` would (done before the baseline)."""
    from hydra import compose, initialize_config_dir

    from offload_core.runner.config import register_configs

    register_configs()
    budgets = [f"++max_memory.{device}={size}" for device, size in max_memory_of(spec).items()]
    overrides = [
        "model=synthetic" if spec["preset"] else "model=local",
        f"model.preset={spec['preset']}" if spec["preset"] else f"model.path={spec['checkpoint']}",
        f"storage={spec['store']}",
        f"hook={spec['policy']}",
        *budgets,
        f"dtype={spec['dtype']}",
        f"max_new_tokens={spec['tokens']}",
        f"execution_device={execution_device(spec)}",
        "progress=false",
        *spec.get("overrides", []),
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    return cfg, overrides


def load_ours(spec: dict, cfg) -> tuple[torch.nn.Module, dict]:
    """Load through the runner's own steps (settings, strategies, model, plan, dispatch); the dispatch
    stays open until ``info["_release"]`` is closed."""
    from contextlib import ExitStack

    from omegaconf import OmegaConf

    from offload_core.jobs.context import dispatched
    from offload_core.plan.batches import Batches
    from offload_core.plan.model import open_model
    from offload_core.plan.predict import calibrate_and_predict
    from offload_core.plan.prepare import prepare
    from offload_core.runner.settings import build_strategies, read_settings

    offload_folder = str(Path(spec["scratch"]) / "offload") if spec["store"] == "memmap" else None
    settings = read_settings(OmegaConf.merge(cfg, {"offload_folder": offload_folder}), output_dir=spec["scratch"])
    strategies = build_strategies(settings)
    batch = spec.get("batch", 1)

    def batches_of(run_model):  # the benchmark's own prompt ids, ``batch`` rows of them
        ids = prompt_ids(spec["prompt"], run_model.model.config.vocab_size)[0].tolist()
        return Batches([spec["prompt"]] * batch, [ids] * batch, batch)

    release = ExitStack()  # the runner's own prepare step (model, checkpoint, memory, plan), in the load time
    job = release.enter_context(prepare(settings, strategies, predict=False, batches_of=batches_of))
    settings, run_model, ckpt, plan = job.settings, job.run_model, job.checkpoint, job.plan
    reads_gguf = strategies.storage.reads_gguf
    ids, need = job.batches.encoded[0], job.batches.memory
    model = run_model.model
    started = time.perf_counter()
    release.enter_context(dispatched(job))
    dispatch_s = time.perf_counter() - started
    state = model.offload_state
    store = state.store
    if store is None:
        files: list[str] = []
    elif spec["store"] == "memmap":
        files = sorted(str(p) for p in Path(store.folder).glob("*.dat"))
    elif spec["store"] == "safetensors":
        keys = checkpoint_keys(model, ckpt, state.routes.store_keys)
        files = sorted({str(ckpt.file_of(k)) for k in keys})
    else:
        files = []
    ranges = pagecache.whole_files(files)
    if spec["store"] == "safetensors" and store is not None:
        # the offloaded tensors' own bytes within the shards (the shards also hold resident tensors)
        ranges = [(str(ckpt.file_of(k)), *ckpt.safetensors_file(ckpt.file_of(k)).byte_range(k)) for k in keys]
    devices = plan.summary["devices"]
    info = {
        "dispatch_s": dispatch_s,
        "offload_files": files,
        "offload_ranges": ranges,
        "offloaded_bytes": state.offloaded_bytes(),
        "store_bytes_written": store.bytes_written if store is not None else 0,
        "device_bytes": {str(d): v["bytes"] for d, v in devices.items()},
        "converting": len(getattr(store, "converting", ()) or ()),
        "_release": release,
        "_policy": strategies.names["hook"],
        "planned_batch_bytes": need.total,
        # predicted on an empty copy of the model, as run.py predicts before it dispatches (the dispatched model's
        # blocks carry their hooks and weights)
        "_predict": lambda: calibrate_and_predict(
            settings,
            strategies,
            open_model(settings.model, settings.dtype, reads_gguf),
            plan,
            batch,
            len(ids),
            cold=spec["cold"],
        ),
    }
    return model, info


def graph_counters(model) -> dict:
    """A graphs system's captures, replays and eager steps (none for the others)."""
    from offload_core.module_hooks.base import module_hooks

    return next((h.counters() for h in module_hooks(model) if hasattr(h, "replays")), {})


def checkpoint_keys(model, ckpt, keys) -> list[str]:
    """The checkpoint tensors behind the store's ``keys``: a key the checkpoint holds, or the sources of a tensor
    built from several (a fused expert tensor from its per-expert tensors)."""
    from offload_core.loading.conversion import key_conversion

    converted = key_conversion(model, ckpt).converted
    found = []
    for key in keys:
        found += [key] if key in ckpt else list(converted[key].sources) if key in converted else []
    return found


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    torch.manual_seed(0)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    spec["threads_used"] = torch.get_num_threads()
    import offload_core

    spec["offload_core_file"] = offload_core.__file__
    kind = spec["kind"]
    cfg = None
    if kind == "ours":
        cfg, overrides = prepare_ours(spec)
        spec["overrides_used"] = overrides
    elif kind == "accelerate":
        import accelerate  # noqa: F401  (imported before the baseline, like everything else)
    config = AutoConfig.from_pretrained(spec["checkpoint"])
    for architecture in config.architectures or []:  # its modeling module too, imported lazily by transformers
        getattr(transformers, architecture, None)
    cuda = on_gpu(spec)
    input_ids = prompt_ids(spec["prompt"], config.vocab_size, spec.get("batch", 1)).to(execution_device(spec))
    h2d = None
    if cuda:
        h2d = pinned_h2d_bandwidth()
        torch.cuda.reset_peak_memory_stats()  # the peak is the system's, not the measurement's buffers
    gc.collect()
    baseline_anon, baseline_file = rss_split()
    with MemoryMonitor() as memory:
        started = time.perf_counter()
        if kind == "ours":
            model, info = load_ours(spec, cfg)
        elif kind == "accelerate":
            model, info = load_accelerate(spec)
        else:
            model, info = load_inmem(spec)
            if spec["system"] in ("inmem-static", "inmem-graphs"):
                model.generation_config.cache_implementation = "static"
            if spec.get("graphs"):
                from offload_core.module_hooks.graphs import apply_graphs

                apply_graphs(model)
        load_s = time.perf_counter() - started
        after_load_anon = rss_split()[0] - memory.baseline_anon
        cold_files = info["offload_files"] if spec["cold"] else []
        bandwidths = []
        if cold_files:
            # Files written at load (an offload folder) still being flushed would compete with the
            # token's reads: every system's writes reach the disk first (not counted anywhere).
            os.sync()
            # The disk's sequential bandwidth on the offloaded bytes, before and after decoding.
            bandwidths += [
                pagecache.sequential_read_bandwidth(info["offload_ranges"]) for _ in range(BANDWIDTH_SAMPLES - 2)
            ]
        warmup_s = None
        if cuda:
            # CUDA's first kernels, cuBLAS's workspace and autotuning cost seconds spread over the first tokens
            # (5.8 s against 0.9 s for a second 32-token generate on an H100): every system gets one short
            # untimed generate first, which also records the prefetch order.
            started_warmup = time.perf_counter()
            generate(model, input_ids, 2, [])
            warmup_s = time.perf_counter() - started_warmup
        state = getattr(model, "offload_state", None)
        if state is not None:
            state.stats.reset()
        io_before = read_io_bytes()
        tokens, timer = generate(model, input_ids, spec["tokens"], cold_files, state.stats if state else None)
        io_read = read_io_bytes() - io_before
        moved = state.stats.snapshot()["bytes"] if state is not None else info["offloaded_bytes"] * len(tokens)
        memory.sample()
    stamps = timer.stamps
    intervals = [b - a for a, b in zip(stamps, stamps[1:])]
    result = {
        **{k: v for k, v in spec.items() if k != "scratch"},
        "load_s": load_s,
        "dispatch_s": info.get("dispatch_s"),
        "warmup_s": warmup_s,
        "time_to_first_token_s": stamps[0] - timer.start,
        "load_to_first_token_s": load_s + stamps[0] - timer.start,
        "decode_tokens_per_s": len(intervals) / sum(intervals) if intervals else float("nan"),
        "batch": spec.get("batch", 1),
        "aggregate_tokens_per_s": spec.get("batch", 1) * len(tokens) / (stamps[-1] - timer.start),
        "planned_batch_bytes": info.get("planned_batch_bytes"),
        "decode_token_s": sorted(intervals)[len(intervals) // 2] if intervals else float("nan"),
        "decode_token_mean_s": sum(intervals) / len(intervals) if intervals else float("nan"),
        "generated_tokens": len(tokens),
        "token_ids": tokens,
        **graph_counters(model),
        "baseline_anon_rss_bytes": baseline_anon,
        "baseline_file_rss_bytes": baseline_file,
        "peak_anon_rss_bytes": memory.anon_delta,
        "peak_file_rss_bytes": memory.file_delta,
        "anon_rss_after_load_bytes": after_load_anon,
        "bytes_read_per_token": moved / max(len(tokens), 1),
        # the decode tokens' alone (the prompt's, read whole by some policies, left out), as the decode times are
        "bytes_moved_per_decode_token": (timer.moved[-1] - timer.moved[0]) / (len(timer.moved) - 1)
        if len(timer.moved) > 1
        else None,
        "disk_read_bytes_per_token": io_read / max(len(tokens), 1),
        "disk_read_bytes_per_decode_token": (timer.io[-1] - timer.io[0]) / (len(timer.io) - 1)
        if len(timer.io) > 1
        else None,
        "offloaded_bytes": info["offloaded_bytes"],
        "store_bytes_written": info["store_bytes_written"],
        "device_bytes": info["device_bytes"],
        "device_map": {name: str(device) for name, device in (getattr(model, "hf_device_map", None) or {}).items()},
        "offload_file_count": len(info["offload_files"]),
        "converting_tensors": info.get("converting", 0),
    }
    if cuda:
        torch.cuda.synchronize()
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        result["h2d_bytes_per_s"] = h2d = max(h2d, pinned_h2d_bandwidth())  # before and after: the better one
        per_token = result["bytes_moved_per_decode_token"]
        ideal = (per_token if per_token is not None else result["bytes_read_per_token"]) / h2d
        result["ideal_h2d_s_per_token"] = ideal
        result["h2d_token_over_ideal"] = result["decode_token_mean_s"] / ideal if ideal else None
        # streaming every offloaded byte each token: the bound hybrid=true computes part of them on the host to beat
        result["copy_only_s_per_token"] = copy_only = (info["offloaded_bytes"] or 0) / h2d
        result["token_over_copy_only"] = result["decode_token_mean_s"] / copy_only if copy_only else None
    result["read_bandwidth_bytes_per_s"] = result["bytes_read_per_token"] / result["decode_token_mean_s"]
    if spec["cold"] and info["offload_files"]:
        result["cached_fraction_after_drop_max"] = max(timer.cached_after_drop) if timer.cached_after_drop else None
        bandwidths += [pagecache.sequential_read_bandwidth(info["offload_ranges"]) for _ in range(2)]
        bandwidth, nbytes, _ = sorted(bandwidths)[len(bandwidths) // 2]  # the median sample
        result["sequential_read_bytes_per_s"] = bandwidth
        result["sequential_read_samples_bytes_per_s"] = [b[0] for b in bandwidths]
        result["sequential_read_bytes"] = nbytes
        ideal = result["bytes_read_per_token"] / bandwidth
        result["ideal_read_s_per_token"] = ideal
        result["cold_token_over_ideal"] = result["decode_token_mean_s"] / ideal if ideal else None
        result["disk_read_bandwidth_bytes_per_s"] = result["disk_read_bytes_per_token"] / result["decode_token_mean_s"]
    if "_predict" in info:
        result.update(info["_predict"]())  # after the measurement: a first calibration is not timed
    if state is not None:
        from offload_core.jobs.results import per_token_counters

        policy = info["_policy"]
        result.update(
            {
                f"{policy}_{name}": value
                for name, value in per_token_counters(state.handle.counters(), len(tokens)).items()
            }
        )
        info["_release"].close()
    out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="offload-bench-", dir=os.environ.get("BENCH_SCRATCH")) as scratch:
        spec_in = json.loads(sys.argv[1])
        spec_in["scratch"] = scratch
        sys.argv[1] = json.dumps(spec_in)
        main()
