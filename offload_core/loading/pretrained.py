"""One call from a checkpoint folder or Hub repo id to a ready, offloaded model of the right class:
``from_pretrained``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from offload_core import defaults
from offload_core.plan.request import PlanRequest, dispatch, plan_request
from offload_core.planning.generation import Generation
from offload_core.storage.checkpoint import Checkpoint
from offload_core.values import budget_key


def from_pretrained(
    path: str | Path,
    max_memory: Mapping[Any, int | str] | int | float | str | None = None,
    placement: str | Any = defaults.PLACEMENT,
    storage: str | Any = defaults.STORAGE,
    policy: str | Any | None = None,
    offload_folder: str | Path | None = None,
    dtype: torch.dtype | str | None = None,
    task: str | None = None,
    *,
    device_map: Mapping[str, int | str] | None = None,
    execution_device: torch.device | str | None = None,
    no_split_module_classes: list[str] | None = None,
    progress: bool = False,
    page_cache: int | str | None = defaults.PAGE_CACHE,
    speculative: Any = None,
    headroom: int | str | None = defaults.HEADROOM,
    plan_call: Mapping[str, Any] | None = None,
    generation: Generation | Mapping[str, int] | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    cache_dir: str | Path | None = None,
    graphs: bool = False,
    hybrid: bool = False,
    over_budget: str = "warn",
) -> nn.Module:
    """Build the ``task`` model of the checkpoint folder ``path`` (default: what ``config.architectures`` names),
    plan where each weight lives within ``max_memory`` and load it, ready to call: the model has
    ``hf_device_map`` (as transformers sets it) and ``offload_state``.

    ``max_memory`` is a dict of budgets by device (``{0: "10GiB", "cpu": "20GiB"}``, as accelerate's), or one size
    (``"200MB"``, ``2e8``): the execution device's budget (on a GPU run the cpu's is then its available memory); None
    reads this machine's free memory.

    ``placement``, ``storage`` and ``policy`` are plugin names or built strategies; ``device_map`` (a dict)
    replaces the placement. The defaults are ``run.py``'s (:mod:`offload_core.defaults`: ``sequential``,
    ``safetensors``, ``align_per_call``, ``page_cache="auto"``, ``headroom="auto"``), and the plan is made by the same
    rule (:func:`offload_core.plan.request.plan_request`): the placement holds back what the policy's units in
    flight need, and the generation's KV cache and activations (below). ``dtype`` None runs in the checkpoint's dtype;
    ``execution_device`` defaults to ``cuda:0`` when present, else ``cpu``. ``model.offload_state.remove()`` undoes
    the offloading. A budget the plan cannot hold (the policy's units in flight, a block larger than it) is run
    over with a warning naming by how much; ``over_budget="refuse"`` makes it a
    :class:`~offload_core.errors.ConfigError`.

    ``page_cache``, as ``run.py``'s: a set of the offloaded blocks stays in the page cache across calls and the
    rest is streamed, each dropped once it has run (``"auto"``: the memory available less the cpu budget and a
    margin, the default; a size such as ``"8GiB"``; ``0`` streams every block). None (or ``"lru"``) leaves what stays
    to the kernel's cache. The kept set's figures are in ``model.offload_state.handle.counters()``.

    ``path`` may also be a Hugging Face Hub repo id (``"org/name"``), as in transformers: an existing local path wins;
    otherwise the repo's snapshot folder in the Hub cache (``HF_HUB_CACHE``, ``HF_HOME`` or ``cache_dir``) at
    ``revision`` (a branch, tag or commit; default ``main``) is used, downloaded first (with huggingface_hub's
    progress bars) unless ``HF_HUB_OFFLINE=1`` or ``local_files_only`` forbid it. ``token`` (default ``HF_TOKEN`` or
    the saved login) reads private or gated repos.

    ``policy`` None is ``align_per_call``, for a model and a pipeline alike. A diffusers pipeline folder (one with
    ``model_index.json``) gives the pipeline, its module components planned as one model (keys prefixed by component)
    and dispatched; ``chained`` moves a component whole when called and keeps it until the next one is called
    (components up to half the execution device's budget move whole; larger ones split at their own blocks).

    ``headroom`` is held back from the execution device's budget for what runs beside the weights (bytes or a size
    such as ``"512MiB"``). ``"auto"`` (the default) holds back, as ``run.py`` does: for a model that generates, the KV
    cache and activations of ``generation`` (a :class:`~offload_core.planning.generation.Generation` or a dict of its
    fields: ``max_new_tokens``, ``batch_size``, ``prompt_tokens``; default ``run.py``'s 16 new tokens, batch 1, after
    a prompt of 32 tokens) and the runtime's slack, a generation that cannot fit refused in one line naming what
    fits (a longer ``generate`` than planned can go over ``max_memory``); for another model a fixed allowance; for a
    pipeline, the activations of the call ``plan_call`` gives (the pipeline's keyword arguments, such as
    ``{"height": 1024, "width": 1024, "num_images_per_prompt": 2}``; default one image of its default size), traced
    on fake tensors before loading, and the runtime's slack. ``model.offload_plan.held`` says what was held back.
    ``auto=True`` (``run.py``'s prediction and choice) is not here: the cost model lives in the runner.

    ``speculative`` (``"prompt_lookup"``, ``"self"``, ``"draft"`` or a dict/``SpeculativeConfig`` such as
    ``{"name": "draft", "path": ...}``) prepares speculative decoding as ``run.py``'s ``speculative=``: a draft's
    weights and KV cache (for ``generation``) are taken from the execution device's budget before the placement, a
    self draft's first layers must be resident. ``model.speculation.generate(ids, max_new_tokens=...)`` generates
    with it; then
    ``model.speculation.figures(new_tokens)`` gives passes, tokens per pass, drafted and accepted tokens.

    ``graphs=True`` (a CUDA GPU; ``policy="prefetch"`` and ``storage="pinned_cpu"`` where anything is offloaded)
    captures one-token decoding steps with a static KV cache and replays them (:func:`apply_graphs`); the plan holds
    the graph's memory pool back from the execution device's budget (:func:`graph_pool_bytes`).

    ``hybrid=True`` (a GPU run; ``policy`` None or ``prefetch``): decoding steps of one sequence compute a share of the
    offloaded blocks on the host from their host-resident weights while the others stream in, the split solved from
    rates measured on the model as it is dispatched (tokens may then differ from the all-GPU run by CPU/GPU rounding).
    """
    from offload_core.loading.hub import resolve_model_path
    from offload_core.loading.pipeline import is_pipeline_folder

    path = resolve_model_path(
        path, revision=revision, token=token, local_files_only=local_files_only, cache_dir=cache_dir, what="path"
    )
    if is_pipeline_folder(path):
        from offload_core.loading.pipeline_load import pipeline_from_pretrained

        if speculative not in (None, "none"):
            from offload_core.errors import ConfigError

            raise ConfigError(f"speculative={speculative!r} decodes tokens; {path} is a diffusers pipeline: drop it")
        if generation is not None:
            from offload_core.errors import ConfigError

            raise ConfigError(
                f"generation plans the KV cache of a generation; {path} is a diffusers pipeline: drop it (plan_call "
                "plans a pipeline's call)"
            )

        return pipeline_from_pretrained(
            path,
            max_memory,
            placement,
            storage,
            policy or defaults.POLICY,
            offload_folder,
            dtype,
            device_map=device_map,
            execution_device=execution_device,
            progress=progress,
            page_cache=page_cache,
            headroom=headroom,
            plan_call=plan_call,
            over_budget=over_budget,
        )
    if graphs and speculative not in (None, "none"):
        from offload_core.errors import GraphsError
        from offload_core.module_hooks.graphs import graphs_refusal

        raise GraphsError(graphs_refusal(execution_device or "cuda", None, None, True))
    if plan_call is not None:
        from offload_core.errors import ConfigError

        raise ConfigError(f"plan_call plans a diffusers pipeline's call; {path} is a transformers checkpoint: drop it")
    given_policy, policy = policy, policy or ("prefetch" if graphs else defaults.POLICY)
    from offload_core.loading.checkpoint import Checkpoint
    from offload_core.loading.execution_device import default_execution_device
    from offload_core.loading.tasks import GENERATIVE, build_empty, check_task_fits, config_dtype, infer_task
    from offload_core.loading.tasks import read_config
    from offload_core.planning import get_max_memory, no_split_classes
    from offload_core.planning.budgets import check_budgets, check_execution_device, read_max_memory
    from offload_core.planning.generation import read_generation
    from offload_core.planning.headroom import read_headroom
    from offload_core.speculative import read_speculative
    from offload_core.values import parse_dtype

    path = model_path(path, storage)
    config = read_config(path, what="path")
    given = task is not None
    task = task or infer_task(config)
    dtype = parse_dtype(dtype) or config_dtype(config)
    model = build_empty(config, task, dtype, what="task")
    if execution_device is not None:  # checked as run.py checks its execution_device and max_memory
        device = check_execution_device(execution_device)
    else:
        device = default_execution_device(device_map if isinstance(device_map, Mapping) else None)
    if hybrid:
        from offload_core.module_hooks.prefetch.hybrid import hybrid_policy

        policy = hybrid_policy(given_policy, device)
    max_memory = read_max_memory(max_memory, device)
    if graphs:
        from offload_core.errors import GraphsError
        from offload_core.loading.dispatch import resolve_strategy
        from offload_core.module_hooks.graphs import graph_pool_bytes, graphs_refusal

        policy_name = policy if isinstance(policy, str) else "prefetch"
        pinned = resolve_strategy("storage", storage).pinned
        refusal = graphs_refusal(device, policy_name, pinned, False)
        if refusal is not None:
            raise GraphsError(refusal)
        if max_memory is not None:  # the graph's pool is held back from the execution device's budget
            budgets = get_max_memory(max_memory, check_devices=False)
            key = budget_key(device)
            if key in budgets:
                budgets[key] -= graph_pool_bytes(config, dtype=dtype)
            max_memory = budgets
    if max_memory is not None:
        check_budgets(get_max_memory(max_memory, check_devices=False), device)
    no_split = no_split_classes(model, no_split_module_classes)
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
            placement=placement,
            storage=storage,
            policy=policy,
            page_cache=page_cache,
            headroom=read_headroom(headroom),
            generation=read_generation(generation) if task in GENERATIVE else None,
            speculative=read_speculative(speculative),
            device_map=device_map,
            offload_folder=offload_folder,
            progress=progress,
            over_budget=over_budget,
        )
    except BaseException:
        checkpoint.close()
        raise
    model = plan_and_dispatch(model, checkpoint, request)
    if graphs:
        from offload_core.module_hooks.graphs import apply_graphs

        apply_graphs(model, device)
    return model


def plan_and_dispatch(model: nn.Module, checkpoint: Checkpoint, request: PlanRequest) -> nn.Module:
    """Plan ``model`` (empty) for ``request`` (:func:`plan_request`) and load the opened ``checkpoint`` into it as
    the plan says (closing the checkpoint if that fails), prepared for the request's speculative decoding: what
    :func:`from_pretrained` does once the model is built. The plan is ``model.offload_plan``."""
    from offload_core.speculative import prepare

    try:
        plan = plan_request(model, checkpoint, request)
        model = dispatch(plan, model, checkpoint, request.offload_folder, request.progress)
        model.speculation = prepare(request.speculative, model, request.dtype, request.execution_device)
        model.offload_plan = plan
        return model
    except BaseException:
        checkpoint.close()
        raise


def quantized_checkpoint(model: nn.Module, checkpoint: Checkpoint, storage: str | Any, dtype: Any) -> Checkpoint:
    """``checkpoint``, or for a store built with ``compute="quantized"`` (``storage=get_registry().create("storage",
    "gguf", {"compute": "quantized"})``) the GGUF checkpoint of the packed linear layers it puts in ``model``."""
    from offload_core.loading.dispatch import resolve_strategy

    if not resolve_strategy("storage", storage).quantized_compute:
        return checkpoint
    from offload_core.loading.gguf_qcompute import compute_quantized

    return compute_quantized(model, checkpoint, dtype)


def model_path(path: str | Path, storage: str | Any) -> Path:
    """``path`` as the loaders take it: a GGUF file (or a folder holding one) stays the file for a store that reads
    it in place (``storage="gguf"``) and is converted once into a float32 safetensors folder for the others."""
    from offload_core.loading.dispatch import resolve_strategy
    from offload_core.loading.gguf_sources import resolve_model_path

    reads_gguf = resolve_strategy("storage", storage).reads_gguf
    return resolve_model_path(path, reads_gguf)
