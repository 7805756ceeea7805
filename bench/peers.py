"""The peers a benchmark worker loads beside offload_core (accelerate, the in-memory model), and the spec's device
rules they share with it (``bench/worker.py``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pagecache


def on_gpu(spec: dict) -> bool:
    """``--device cuda``: every system runs on GPU 0."""
    return spec.get("device") == "cuda"


def execution_device(spec: dict) -> str:
    return "cuda:0" if on_gpu(spec) else "cpu"


def max_memory_of(spec: dict) -> dict:
    """CPU runs: ``--budget`` is the cpu budget. GPU runs: it is GPU 0's, and the rest fits in cpu memory."""
    if on_gpu(spec):
        return {0: spec["budget"], "cpu": int(spec["cpu_budget"])}  # bytes as an int: accelerate takes no digit strings
    budget = spec["budget"]
    return {
        "cpu": int(budget) if str(budget).isdigit() else budget
    }  # bytes as an int: accelerate takes no digit strings


def load_accelerate(spec: dict) -> tuple[torch.nn.Module, dict]:
    from accelerate import infer_auto_device_map, init_empty_weights, load_checkpoint_and_dispatch

    dtype = getattr(torch, spec["dtype"])
    config = AutoConfig.from_pretrained(spec["checkpoint"])
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    no_split = list(getattr(model, "_no_split_modules", None) or ["LlamaDecoderLayer"])
    device_map = infer_auto_device_map(
        model, max_memory=max_memory_of(spec), no_split_module_classes=no_split, dtype=dtype
    )
    folder = Path(spec["scratch"]) / "offload"
    started = time.perf_counter()
    shards = sorted(str(p) for p in Path(spec["checkpoint"]).glob("*.safetensors"))
    if _names_match(model, shards):
        model = load_checkpoint_and_dispatch(
            model,
            spec["checkpoint"],
            device_map=device_map,
            offload_folder=str(folder),
            dtype=dtype,
            no_split_module_classes=no_split,
        )
        files = []
    else:
        # The checkpoint's names are not the model's (a transformers-5 MoE: per-expert tensors, fused
        # parameters): accelerate's own loader cannot read it, so transformers loads it with the same
        # device map and accelerate's disk offload (converted tensors written to the folder, the others
        # read from the shards in place).
        del model
        model = AutoModelForCausalLM.from_pretrained(
            spec["checkpoint"], dtype=dtype, device_map=device_map, offload_folder=str(folder)
        )
        files = shards
    dispatch_s = time.perf_counter() - started
    model.eval()
    written_files = sorted(str(p) for p in folder.iterdir()) if folder.exists() else []
    written = sum(os.path.getsize(p) for p in written_files)
    files = written_files + files
    per_device: dict[str, int] = {}
    for name, dev in device_map.items():
        size = sum(
            t.numel() * t.element_size()
            for t in (model.get_submodule(name).state_dict().values() if name else model.state_dict().values())
        )
        per_device[str(dev)] = per_device.get(str(dev), 0) + size
    # On a GPU run accelerate streams both its cpu and its disk weights to the GPU on every forward.
    offloaded = per_device.get("disk", 0) + (per_device.get("cpu", 0) if on_gpu(spec) else 0)
    info = {
        "dispatch_s": dispatch_s,
        "offload_files": files,
        "offload_ranges": pagecache.whole_files(files),
        "offloaded_bytes": offloaded,
        "store_bytes_written": written,
        "device_bytes": per_device,
    }
    return model, info


def _names_match(model: torch.nn.Module, shards: list[str]) -> bool:
    """Whether every name of ``model``'s state dict is a tensor of the safetensors ``shards`` (no conversion needed)."""
    from safetensors import safe_open

    names: set[str] = set()
    for shard in shards:
        with safe_open(shard, "pt") as handle:
            names.update(handle.keys())
    return not shards or set(model.state_dict()) <= names


def load_inmem(spec: dict) -> tuple[torch.nn.Module, dict]:
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=getattr(torch, spec["dtype"]))
    model.eval()
    if on_gpu(spec):
        model.to("cuda")
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return model, {"offload_files": [], "offloaded_bytes": 0, "store_bytes_written": 0, "device_bytes": {"cpu": total}}
