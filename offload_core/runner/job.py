"""The thin runner: compose a placement, a store and a module-hook policy from a config, load, generate, report."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from offload_core.errors import ConfigError
from offload_core.values import format_size, parse_dtype, parse_size

log = logging.getLogger("offload_core")


@dataclass
class RunResult:
    """What :func:`run` returns (and writes as ``metrics.json`` / ``device_map.json``)."""

    text: str
    token_ids: list[int]
    device_map: dict[str, Any]
    figures: dict[str, Any]
    summary: dict[str, Any]
    matches_in_memory: bool | None = None
    output_dir: Path | None = None
    plan: dict[str, Any] = field(default_factory=dict)


def _section(cfg: Any, key: str) -> dict:
    node = cfg.get(key) if isinstance(cfg, DictConfig) else cfg[key]
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def _execution_device(value: str | None) -> torch.device:
    if value in (None, "", "auto"):
        from offload_core.loading.dispatch import default_execution_device

        return default_execution_device()
    try:
        device = torch.device(value)
    except RuntimeError:
        raise ConfigError(f"execution_device={value!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ConfigError(f"execution_device={value!r} does not exist: this machine has {count} CUDA device(s); use cpu")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ConfigError(f"execution_device={value!r} is not supported: use cpu or cuda:N")
    return device


def _max_memory(raw: dict, execution_device: torch.device) -> dict[Any, int]:
    budgets: dict[Any, int] = {}
    for key, value in raw.items():
        key_s = str(key)
        if key_s in ("cpu", "disk"):
            dev: Any = key_s
        elif key_s.removeprefix("cuda:").isdigit():
            dev = int(key_s.removeprefix("cuda:"))
            if execution_device.type == "cuda" and dev >= torch.cuda.device_count():
                raise ConfigError(f"max_memory.{key_s}: GPU {dev} does not exist (this machine has {torch.cuda.device_count()}); remove it")
            if execution_device.type == "cpu":
                raise ConfigError(f"max_memory.{key_s}: a GPU budget on a CPU run; remove it or set execution_device=cuda")
        else:
            raise ConfigError(f"max_memory has an unknown device {key_s!r}: use cpu, disk or a GPU index like 0")
        if value is None:
            continue
        size = parse_size(value, what=f"max_memory.{key_s}")
        if size == 0 and dev != "disk":
            raise ConfigError(f"max_memory.{key_s}=0 leaves nothing to run with: give a size above 0 or remove the key")
        budgets[dev] = size
    return budgets


def _check_disk_budget(summary: dict, max_memory: dict, largest_block: int, headroom: int) -> None:
    """A ``disk`` budget is a limit: ``max_memory.disk=0`` means nothing may be offloaded to disk."""
    if "disk" not in max_memory:
        return
    on_disk = summary["devices"].get("disk", {}).get("bytes", 0)
    allowed = max_memory["disk"]
    if on_disk <= allowed:
        return
    short = on_disk - allowed
    needed = summary["devices"].get("cpu", {}).get("bytes", 0) + short + headroom
    memory = ", ".join(f"max_memory.{k}={format_size(v)}" for k, v in max_memory.items() if k != "disk") or "no memory budget"
    if headroom:
        memory += f" less headroom {format_size(headroom)}"
    raise ConfigError(
        f"the model ({format_size(summary['total_bytes'])}; largest unsplittable layer {format_size(largest_block)}) does not "
        f"fit in {memory} with max_memory.disk={format_size(allowed)}: {short} more bytes are needed; "
        f"set max_memory.cpu to at least {needed} ({format_size(needed)}) or allow disk (raise or remove max_memory.disk)"
    )


def resolve_checkpoint(model_cfg: dict) -> Path:
    """The local checkpoint folder the model config names (converting/creating it once if needed)."""
    from offload_core.loading import sources

    if model_cfg.get("path"):
        path = Path(model_cfg["path"]).expanduser()
        if not path.exists():
            raise ConfigError(f"model.path={str(path)!r} does not exist: give a local Hugging Face checkpoint folder")
        return path
    name = model_cfg.get("name")
    if name == "smollm2":
        return sources.smollm2_checkpoint()
    if name == "synthetic":
        return sources.synthetic_checkpoint(**sources.synthetic_preset(model_cfg.get("preset", "tiny")))
    raise ConfigError(f"model.name={name!r} needs model.path=<a local checkpoint folder> (known names: smollm2, synthetic)")


def build_empty_model(checkpoint: Path, dtype: torch.dtype | None):
    """The model of ``checkpoint``'s config with every weight on the meta device; returns (model, dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from offload_core.loading.empty import init_empty_weights

    try:
        config = AutoConfig.from_pretrained(checkpoint)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{checkpoint} has no usable config.json ({str(exc).splitlines()[0]}); point model.path at a Hugging Face checkpoint folder") from None
    if dtype is None:
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = parse_dtype(str(stored)) if stored is not None else torch.float32
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model, dtype


def reservation(policy: Any, storage: Any, execution_device: torch.device, block_bytes: int, module_bytes: int,
                converts: bool) -> dict[Any, int]:
    """Bytes the placement must hold back for the units in flight: the policy's answer (its ``reserve``),
    given what the storage declares (``converts_on_read``: a checkpoint dtype other than the run's
    (``converts``) makes copies on read; ``pinned``: no staging needed for a GPU)."""
    from offload_core.module_hooks.units import InFlight, policy_reservation

    need = InFlight(execution_device, block_bytes, module_bytes,
                    store_converts=converts and bool(getattr(storage, "converts_on_read", False)),
                    store_pinned=bool(getattr(storage, "pinned", False)))
    return policy_reservation(policy, need)


def _prompt_ids(tokenizer, prompt: str, chat: bool, vocab_size: int) -> torch.Tensor:
    if tokenizer is None:
        # Synthetic models have no tokenizer: a deterministic id per prompt byte.
        return torch.tensor([[1 + b % (vocab_size - 1) for b in prompt.encode()]], dtype=torch.long)
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt")
        return ids if torch.is_tensor(ids) else ids["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def _generate(model, input_ids: torch.Tensor, cfg: Any, device: torch.device):
    from transformers import StoppingCriteriaList

    from offload_core.runner.metrics import TokenTimer

    torch.manual_seed(int(cfg.seed))
    timer = TokenTimer(total=int(cfg.max_new_tokens), progress=bool(cfg.get("progress", False)))
    kwargs: dict[str, Any] = {"max_new_tokens": int(cfg.max_new_tokens), "do_sample": bool(cfg.do_sample)}
    if cfg.do_sample:
        kwargs.update(temperature=float(cfg.temperature), top_k=int(cfg.top_k), top_p=float(cfg.top_p))
    pad = getattr(model.generation_config, "pad_token_id", None) or getattr(model.config, "eos_token_id", None)
    with torch.inference_mode():
        try:
            out = model.generate(input_ids.to(device), attention_mask=torch.ones_like(input_ids).to(device),
                                 stopping_criteria=StoppingCriteriaList([timer]), pad_token_id=pad, **kwargs)
        finally:
            timer.close()
    return out[0, input_ids.shape[1]:].tolist(), timer


def in_memory_tokens(checkpoint: Path, dtype: torch.dtype, input_ids: torch.Tensor, cfg: Any) -> list[int]:
    """Greedy tokens of the same checkpoint loaded fully in memory by transformers (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    model.eval()
    tokens, _ = _generate(model, input_ids, cfg, torch.device("cpu"))
    del model
    return tokens


def run(cfg: Any, output_dir: str | Path | None = None, labels: dict | None = None, plot: bool = True) -> RunResult:
    """Run one job from a composed config (``run.py`` calls this; tests call it directly).

    ``plot=False`` leaves out ``placement.png`` in a ``plan_only`` run (a caller that only wants the plan).
    """
    from offload_core.loading import sources
    from offload_core.loading.allocator import return_freed_memory_to_os
    from offload_core.loading.checkpoint import Checkpoint
    from offload_core.loading.dispatch import load_checkpoint_and_dispatch
    from offload_core.runner.metrics import MemoryMonitor
    from offload_core.planning import (
        PlacementRequest,
        check_device_map,
        compute_module_sizes,
        largest_block_size,
        normalize_device_map,
        summarize_device_map,
    )
    from offload_core.registry.manager import get_registry
    from offload_core.runner.report import plan_text, plot_placement, predicted_bytes_per_token
    from offload_core.storage.base import converts

    return_freed_memory_to_os()
    registry = get_registry()
    placement_cfg, storage_cfg, hook_cfg, model_cfg = (_section(cfg, k) for k in ("placement", "storage", "hook", "model"))
    placement = registry.create("placement", placement_cfg["name"], placement_cfg)
    storage = registry.create("storage", storage_cfg["name"], storage_cfg)
    policy = registry.create("hook", hook_cfg["name"], hook_cfg)
    execution_device = _execution_device(cfg.execution_device)
    max_memory = _max_memory(dict(_section(cfg, "max_memory")), execution_device)
    headroom = parse_size(cfg.headroom, what="headroom")
    run_dtype = parse_dtype(cfg.dtype)
    out_dir = Path(output_dir) if output_dir else Path.cwd()

    checkpoint_dir = resolve_checkpoint(model_cfg)
    model, dtype = build_empty_model(checkpoint_dir, run_dtype)
    no_split = model_cfg.get("no_split_module_classes") or list(getattr(model, "_no_split_modules", None) or [])
    with Checkpoint.open(checkpoint_dir) as ckpt:
        stored_differs = any(converts(ckpt.dtype(k), dtype) for k in ckpt.keys())
        block = largest_block_size(model, no_split, dtype=dtype)
        module_bytes = largest_block_size(model, [], dtype=dtype)
        reserve = reservation(policy, storage, execution_device, block, module_bytes, stored_differs)
        budgets = dict(max_memory)
        if execution_device.type == "cpu" and "cpu" in budgets:
            budgets["cpu"] = max(budgets["cpu"] - headroom, 0)
        device_map = _read_device_map(cfg.device_map) if cfg.device_map else None
        if device_map is None and hasattr(policy, "own_device_map"):
            device_map = policy.own_device_map(model, execution_device)  # e.g. functional_call's cpu_offload
        if device_map is None:
            request = PlacementRequest(model=model, max_memory=budgets, no_split_module_classes=no_split, dtype=dtype,
                                       special_dtypes=None, reserve=reserve)
            device_map = placement.make_device_map(request)
        device_map = normalize_device_map(device_map)
        check_device_map(model, device_map, strict=True)
        summary = summarize_device_map(model, device_map, max_memory, dtype=dtype)
        _check_disk_budget(summary, max_memory, block, headroom if execution_device.type == "cpu" else 0)
        plan = {"reserve": {str(k): v for k, v in reserve.items()}, "headroom": headroom, "largest_block": block}
        plan["predicted_bytes_per_token"] = predicted_bytes_per_token(model, device_map, policy, execution_device, dtype, no_split)
        print(f"placement={placement_cfg['name']} storage={storage_cfg['name']} hook={hook_cfg['name']}")
        print(plan_text(summary, plan, plan["predicted_bytes_per_token"], device_map if cfg.plan_only else None))
        _warn_if_fits(summary, execution_device)
        if cfg.plan_only:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "device_map.json").write_text(json.dumps(device_map, indent=1))
            written = "device_map.json"
            if plot:
                picture = plot_placement(model, device_map, compute_module_sizes(model, dtype=dtype), out_dir / "placement.png")
                written = f"{picture} and {written}"
            print(f"wrote {written} (plan only: nothing was loaded)")
            return RunResult("", [], device_map, {}, summary, None, out_dir, plan)

        tokenizer = sources.load_tokenizer(checkpoint_dir)
        input_ids = _prompt_ids(tokenizer, cfg.prompt, model_cfg.get("chat_template", True), model.config.vocab_size)
        with MemoryMonitor() as memory:
            started = time.perf_counter()
            load_checkpoint_and_dispatch(model, ckpt, device_map, no_split_module_classes=no_split, storage=storage,
                                         policy=policy, offload_folder=cfg.offload_folder, dtype=dtype,
                                         execution_device=execution_device, progress=cfg.progress,
                                         offload_buffers=bool(hook_cfg.get("offload_buffers", False)))
            load_s = time.perf_counter() - started
            state = model.offload_state
            try:
                state.stats.reset()
                if execution_device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                tokens, timer = _generate(model, input_ids, cfg, execution_device)
                moved = state.stats.snapshot()
                figures = {
                    "load_s": load_s,
                    "time_to_first_token_s": timer.time_to_first_token,
                    "decode_tokens_per_s": timer.decode_tokens_per_s,
                    "generated_tokens": len(tokens),
                    "bytes_moved_per_token": moved["bytes"] / max(len(tokens), 1),
                    "transfers_per_token": moved["loads"] / max(len(tokens), 1),
                    "offloaded_bytes": state.offloaded_bytes(),
                    "store_bytes_written": getattr(state.store, "bytes_written", 0),
                    "store_reused": bool(getattr(state.store, "reused", False)),
                }
                if execution_device.type == "cuda":
                    figures["peak_gpu_bytes"] = {str(i): torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())}
                prefetcher = getattr(state.handle, "prefetcher", None)
                if prefetcher is not None:
                    figures["prefetch"] = {"hits": prefetcher.hits, "misses": prefetcher.misses, "late": prefetcher.late,
                                           "wait_s_per_token": prefetcher.waited_s / max(len(tokens), 1),
                                           "borrowed": prefetcher.borrowed, "read_again": prefetcher.reread}
            finally:
                state.handle.offload_all()
                if state.store is not None:
                    state.store.close()
        figures["peak_anon_rss_bytes"] = memory.anon_delta
        figures["peak_file_rss_bytes"] = memory.file_delta
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else " ".join(map(str, tokens))
    matches = None
    if cfg.compare_in_memory:
        reference = in_memory_tokens(checkpoint_dir, dtype, input_ids, cfg)
        matches = reference == tokens
        figures["in_memory_tokens"] = reference
    result = RunResult(text, tokens, device_map, figures, summary, matches, out_dir, plan)
    _write_outputs(result, cfg, labels or {})
    _print_result(result)
    return result


def _read_device_map(path: str) -> dict:
    from offload_core.errors import DeviceMapError

    file = Path(path).expanduser()
    try:
        data = json.loads(file.read_text())
    except OSError as exc:
        raise DeviceMapError(f"device_map={path!r} cannot be read ({exc.strerror}); give a JSON file path") from None
    except ValueError as exc:
        raise DeviceMapError(f"device_map file {path!r} is not valid JSON ({exc}); fix the file") from None
    if not isinstance(data, dict):
        raise DeviceMapError(f"device_map file {path!r} must hold a JSON object of name -> device")
    return data


def _warn_if_fits(summary: dict, execution_device: torch.device) -> None:
    """Offloading costs time: say so when the whole model would fit where it runs."""
    import psutil

    devices = summary["devices"]
    total = sum(info["bytes"] for info in devices.values())
    offloaded = sum(info["bytes"] for dev, info in devices.items() if dev == "disk" or (dev == "cpu" and execution_device.type == "cuda"))
    if offloaded == 0:
        return
    if execution_device.type == "cuda":
        free = torch.cuda.mem_get_info(execution_device)[0]
    else:
        free = psutil.virtual_memory().available
    if total < 0.8 * free:
        print(
            f"  warning: the whole model ({format_size(total)}) would fit in the free memory of {execution_device} "
            f"({format_size(free)}), yet {format_size(offloaded)} is offloaded by max_memory; raise the budget "
            "to run it in memory, which is faster"
        )


def _write_outputs(result: RunResult, cfg: Any, labels: dict) -> None:
    out = result.output_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_map.json").write_text(json.dumps(result.device_map, indent=1))
    payload = {
        **labels,
        "prompt": cfg.prompt,
        "text": result.text,
        "token_ids": result.token_ids,
        "matches_in_memory": result.matches_in_memory,
        **result.figures,
        "devices": result.summary["devices"],
    }
    (out / "metrics.json").write_text(json.dumps(payload, indent=1, default=str))


def _print_result(result: RunResult) -> None:
    f = result.figures
    print(f"\n{result.text}\n")
    print(
        f"load {f['load_s']:.2f} s | first token {f['time_to_first_token_s']:.3f} s | "
        f"decode {f['decode_tokens_per_s']:.1f} tok/s | peak anon RSS +{format_size(f['peak_anon_rss_bytes'])} | "
        f"file-backed RSS +{format_size(f['peak_file_rss_bytes'])} | moved {format_size(int(f['bytes_moved_per_token']))}/token"
    )
    if "prefetch" in f:
        p = f["prefetch"]
        print(f"prefetch: {p['hits']} blocks read ahead, {p['misses']} loaded on demand; waited for {p['late']} "
              f"({p['wait_s_per_token']:.3f} s/token); {p['borrowed']} tied tensors borrowed; "
              f"{p['read_again']} read again after the page cache evicted them")
    if result.matches_in_memory is not None:
        print(f"same tokens as in memory: {result.matches_in_memory}")
    print(f"wrote {result.output_dir / 'metrics.json'} and device_map.json")
