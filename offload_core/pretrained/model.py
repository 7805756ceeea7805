"""One call from a checkpoint folder, GGUF file or Hub repo id to a ready, offloaded model of the right class:
``from_pretrained``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from offload_core import defaults
from offload_core.errors import ConfigError, GraphsError
from offload_core.loading.allocator import return_freed_memory_to_os
from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.dispatch import resolve_strategy
from offload_core.loading.execution_device import default_execution_device
from offload_core.loading.gguf_qcompute import quantized_checkpoint
from offload_core.loading.gguf_sources import resolve_model_path as gguf_model_path
from offload_core.loading.hub import Hub, read_hub, resolve_model_path
from offload_core.loading.pipeline import is_pipeline_folder
from offload_core.registry.contracts import Storage
from offload_core.loading.tasks import GENERATIVE, build_empty, check_task_fits, config_dtype, infer_task, read_config
from offload_core.module_hooks.graphs import apply_graphs, graph_pool_bytes, graphs_refusal
from offload_core.module_hooks.prefetch.hybrid import hybrid_policy
from offload_core.options import Offload, read_offload
from offload_core.plan.request import PlanRequest, plan_and_dispatch
from offload_core.pretrained.auto import choose_offload
from offload_core.pretrained.pipeline import pipeline_from_pretrained
from offload_core.planning import get_max_memory, no_split_classes
from offload_core.planning.budgets import check_budgets, check_execution_device, check_over_budget, read_max_memory
from offload_core.planning.generation import Generation, read_generation
from offload_core.planning.headroom import read_headroom
from offload_core.speculative import read_speculative
from offload_core.values import budget_key, parse_dtype

log = logging.getLogger(__name__)


def from_pretrained(
    path: str | Path,
    max_memory: Mapping[Any, int | str] | int | float | str | None = None,
    offload: Offload | Mapping[str, Any] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    task: str | None = None,
    generation: Generation | Mapping[str, int] | None = None,
    plan_call: Mapping[str, Any] | None = None,
    hub: Hub | Mapping[str, Any] | None = None,
) -> nn.Module:
    """Build the ``task`` model of the checkpoint folder ``path`` (default: what ``config.architectures`` names),
    plan where each weight lives within ``max_memory`` and load it, ready to call: the model has
    ``hf_device_map`` (as transformers sets it), ``offload_state`` and ``offload_plan``.

    ``max_memory`` is a dict of budgets by device (``{0: "10GiB", "cpu": "20GiB"}``, as accelerate's), or one size
    (``"200MB"``, ``2e8``): the execution device's budget (on a GPU run the cpu's is then its available memory); None
    reads this machine's free memory.

    ``offload`` (an :class:`~offload_core.Offload`, or a dict of its fields such as
    ``{"storage": "memmap", "policy": "prefetch"}``) says how: placement, store, module-hook policy, speculative
    decoding, page-cache rule, headroom, what to do with a budget the plan cannot hold, the execution device, graphs,
    hybrid steps, ``auto``. Its defaults are ``run.py``'s (:mod:`offload_core.defaults`), and the plan is made by the
    same rule (:func:`offload_core.plan.request.plan_request`): the placement holds back what the policy's units in
    flight need and, with ``headroom="auto"``, the KV cache and activations of ``generation`` (a
    :class:`~offload_core.planning.generation.Generation` or a dict of its fields: ``max_new_tokens``,
    ``batch_size``, ``prompt_tokens``; default ``run.py``'s 16 new tokens, batch 1, after a prompt of 32 tokens), a
    generation that cannot fit refused in one line naming what fits (a longer ``generate`` than planned can go over
    ``max_memory``); for a model that does not generate, a fixed allowance. ``model.offload_plan.held`` says what was
    held back. A budget the plan cannot hold (a block larger than it) is refused in one line
    (:class:`~offload_core.errors.ConfigError`); ``over_budget="warn"`` runs over it, naming by how much.

    ``dtype`` None runs in the checkpoint's dtype. ``path`` may also be a GGUF file (or a folder holding one), read in
    place with ``storage="gguf"`` and converted once into a float32 safetensors folder for the other stores; or a
    Hugging Face Hub repo id (``"org/name"``; of a GGUF repo ``"org/name:Q8_0"`` names the quantization; a model
    Ollama has pulled is ``"ollama:name:tag"``), as in transformers: an existing local path wins; otherwise the repo's
    snapshot folder in the Hub cache at ``hub``'s revision (a :class:`~offload_core.Hub` or a dict:
    ``revision``, ``token``, ``local_files_only``, ``cache_dir``) is used, downloaded first (with huggingface_hub's
    progress bars) unless ``HF_HUB_OFFLINE=1`` or ``local_files_only`` forbid it.

    A diffusers pipeline folder (one with ``model_index.json``) gives the pipeline, its module components planned as
    one model (keys prefixed by component) and dispatched; ``chained`` moves a component whole when called and keeps
    it until the next one is called. Its headroom holds the activations of the call ``plan_call`` gives (the
    pipeline's keyword arguments, such as ``{"height": 1024, "width": 1024, "num_images_per_prompt": 2}``; default one
    image of its default size), traced on fake tensors before loading.

    ``speculative`` (``"prompt_lookup"``, ``"self"``, ``"draft"`` or a dict such as ``{"name": "draft", "path":
    ...}``) prepares speculative decoding as ``run.py``'s ``speculative=``: a draft's weights and KV cache are taken
    from the execution device's budget before the placement. ``model.speculation.generate(ids, max_new_tokens=...)``
    generates with it, ``model.speculation.figures(new_tokens)`` gives passes, drafted and accepted tokens.
    ``graphs=True`` (a CUDA GPU) captures one-token decoding steps and replays them (:func:`apply_graphs`), the
    graph's memory pool held back from the budget. ``hybrid=True`` (a GPU run) computes a share of the offloaded
    blocks on the host while the others stream in. ``model.offload_state.remove()`` undoes the offloading.
    """
    offload, hub = read_offload(offload), read_hub(hub)
    if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
        raise ConfigError(
            f"dtype={dtype} is no floating-point dtype: give torch.float32, torch.bfloat16 or torch.float16"
        )
    path = resolve_model_path(path, **vars(hub), what="path")
    if is_pipeline_folder(path):
        check_pipeline_request(path, offload, generation)
        if offload.auto:
            log.warning("auto=True predicts transformers models only; the pipeline loads as configured")
        return pipeline_from_pretrained(path, max_memory, offload, dtype, plan_call)
    if plan_call is not None:
        raise ConfigError(f"plan_call plans a diffusers pipeline's call; {path} is a transformers checkpoint: drop it")
    return_freed_memory_to_os()  # before planning allocates: a block freed into the heap stays in the process
    if offload.graphs and offload.speculative not in (None, "none"):
        raise GraphsError(graphs_refusal(offload.execution_device or "cuda", None, None, True))
    device = model_device(offload)
    max_memory = read_max_memory(max_memory, device)
    table: list[dict[str, Any]] = []
    if offload.auto:  # the store chosen says whether a GGUF file is read in place or converted
        offload, table = choose_offload(
            path, max_memory, offload, (parse_dtype(dtype), task), read_generation(generation)
        )
    storage = resolve_strategy("storage", offload.storage)  # built once: every step below reads the same store
    path = model_path(path, storage)
    config = read_config(path, what="path")
    given = task is not None
    task = task or infer_task(config)
    dtype = parse_dtype(dtype) or config_dtype(config)
    model = build_empty(config, task, dtype, what="task", checkpoint=path)
    planned = read_generation(generation) if task in GENERATIVE else None
    policy = model_policy(offload, device)
    if offload.graphs:
        max_memory = hold_graph_pool(max_memory, device, policy, storage, config, dtype)
    if max_memory is not None:
        check_budgets(get_max_memory(max_memory, check_devices=False), device)
    no_split = no_split_classes(model, offload.no_split_module_classes)
    checkpoint = Checkpoint.open(path)  # stays open while the model's store reads it
    try:
        checkpoint = quantized_checkpoint(model, checkpoint, storage, dtype)
        if given:
            check_task_fits(model, checkpoint, task, what="task")
        request = PlanRequest(
            execution_device=device,
            no_split=no_split,
            dtype=dtype,
            max_memory=max_memory,
            placement=offload.placement,
            storage=storage,
            policy=policy,
            page_cache=offload.page_cache,
            headroom=read_headroom(offload.headroom),
            generation=planned,
            speculative=read_speculative(offload.speculative),
            device_map=offload.device_map,
            offload_folder=offload.offload_folder,
            progress=offload.progress,
            over_budget=check_over_budget(offload.over_budget),
        )
    except BaseException:
        checkpoint.close()
        raise
    model = plan_and_dispatch(model, checkpoint, request)
    model.offload_plan.auto = table
    if offload.graphs:
        apply_graphs(model, device)
    return model


def check_pipeline_request(path: Path, offload: Offload, generation: Any) -> None:
    """Refuse, in one line, what only a model that generates takes when ``path`` is a diffusers pipeline."""
    if offload.speculative not in (None, "none"):
        what = f"speculative={offload.speculative!r}"
        raise ConfigError(f"{what} decodes tokens; {path} is a diffusers pipeline: drop it")
    if generation is not None:
        raise ConfigError(
            f"generation plans the KV cache of a generation; {path} is a diffusers pipeline: drop it (plan_call "
            "plans a pipeline's call)"
        )


def model_device(offload: Offload) -> torch.device:
    """The device that computes: ``offload.execution_device`` (checked as ``run.py`` checks it), else the device
    map's or this machine's default."""
    if offload.execution_device is not None:
        return check_execution_device(offload.execution_device)
    device_map = offload.device_map
    return default_execution_device(device_map if isinstance(device_map, Mapping) else None)


def model_policy(offload: Offload, device: torch.device) -> str | Any:
    """The policy ``offload`` asks for: its own, else ``prefetch`` for graphs, else the default; with ``hybrid`` the
    hybrid policy over it."""
    policy = offload.policy or ("prefetch" if offload.graphs else defaults.POLICY)
    return hybrid_policy(offload.policy, device) if offload.hybrid else policy


def hold_graph_pool(
    max_memory: Mapping[Any, int | str] | None,
    device: torch.device,
    policy: Any,
    storage: Storage,
    config: Any,
    dtype: Any,
) -> Mapping[Any, int | str] | None:
    """``max_memory`` less a CUDA graph's memory pool on the execution device (:func:`graph_pool_bytes`), after
    refusing in one line a run that cannot capture graphs."""
    policy_name = policy if isinstance(policy, str) else "prefetch"
    refusal = graphs_refusal(device, policy_name, storage.pinned, False)
    if refusal is not None:
        raise GraphsError(refusal)
    if max_memory is None:
        return None
    budgets = get_max_memory(max_memory, check_devices=False)
    key = budget_key(device)
    if key in budgets:
        budgets[key] -= graph_pool_bytes(config, dtype=dtype)
    return budgets


def model_path(path: str | Path, storage: Storage) -> Path:
    """``path`` as the loaders take it: a GGUF file (or a folder holding one) stays the file for the built ``storage``
    where it reads it in place (``storage="gguf"``) and is converted once into a float32 safetensors folder for the
    others."""
    return gguf_model_path(path, storage.reads_gguf)
