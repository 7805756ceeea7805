"""The typed request the Python doors make of the plan (:class:`PlanRequest`, its defaults those of
:mod:`offload_core.defaults`) and the one function that plans it by ``run.py``'s rule: the generation's KV cache and
activations and a draft's resident bytes held back from the budget of the device that computes, then the plan; and
:func:`dispatch`, the one door every caller with a plan loads its model by."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from offload_core import defaults
from offload_core.plan.make import Plan, PlanInputs, make_plan
from offload_core.planning.generation import Generation, hold_generation, read_generation
from offload_core.planning.headroom import FORWARD_HEADROOM, check_headroom, less_headroom
from offload_core.registry.manager import get_registry
from offload_core.speculative import SpeculativeConfig, prepare, read_speculative
from offload_core.speculative.drafts import check_self_resident, hold_speculation
from offload_core.storage.checkpoint import Checkpoint
from offload_core.values import device_key


@dataclass
class PlanRequest:
    """What a door asks of the plan beside the empty model and its checkpoint.

    ``max_memory``: the budgets in bytes by device as given (None: this machine's free memory). ``headroom`` None
    plans what runs beside the weights: the KV cache and activations of ``generation`` for a model that generates, a
    fixed allowance (:data:`~offload_core.planning.headroom.FORWARD_HEADROOM`) for one that does not (``generation``
    None). ``device_map`` (a dict) replaces the placement. Strategies are plugin names or built objects.
    """

    execution_device: torch.device
    no_split: list[str]
    dtype: torch.dtype | None = None
    max_memory: Mapping[Any, int | str] | None = None
    placement: str | Any = defaults.PLACEMENT
    storage: str | Any = defaults.STORAGE
    policy: str | Any = defaults.POLICY
    page_cache: int | str | None = defaults.PAGE_CACHE
    headroom: int | None = None
    generation: Generation | None = field(default_factory=Generation)
    speculative: SpeculativeConfig = field(default_factory=lambda: read_speculative(None))
    device_map: Mapping[str, int | str] | None = None
    offload_folder: str | Path | None = None
    progress: bool = False
    #: a budget the plan cannot hold (a block larger than it): "refuse" in one line, or "warn" and run over it
    over_budget: str = defaults.OVER_BUDGET

    @property
    def policy_name(self) -> str:
        return self.policy if isinstance(self.policy, str) else get_registry().name_of("policy", self.policy)


def read_request_generation(model: nn.Module, value: Any) -> Generation | None:
    """The generation to plan ``model`` for: ``value`` checked (:func:`read_generation`; None: the defaults) for a
    model that generates (transformers' ``can_generate``: a causal or seq2seq LM), None for another."""
    can_generate = getattr(model, "can_generate", None)  # a transformers model's; another module does not generate
    return read_generation(value) if callable(can_generate) and can_generate() else None


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype ``model``'s floating-point parameters are in (float32 where it has none): what it runs in when no
    dtype is given."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def resolved(request: PlanRequest) -> tuple[Any, Any, Any]:
    """The request's placement (``auto`` is ``balanced``, as in transformers), store and policy, built."""
    from offload_core.loading.dispatch import resolve_strategy

    placement = "balanced" if request.placement == "auto" else request.placement
    return (
        resolve_strategy("placement", placement),
        resolve_strategy("storage", request.storage),
        resolve_strategy("policy", request.policy),
    )


def plan_request(model: nn.Module, checkpoint: Checkpoint, request: PlanRequest) -> Plan:
    """The plan of the empty ``model`` loaded from the opened ``checkpoint`` for ``request``, by the rule every door
    shares: the generation's memory held back (:func:`hold_generation`), then a draft's (:func:`hold_speculation`),
    then the headroom taken from the budget of the device that computes, then the plan
    (:func:`offload_core.plan.make.make_plan`), whose ``held`` says what was held for the run beside its weights."""
    from offload_core.planning import get_max_memory

    placement, storage, policy = resolved(request)
    device = request.execution_device
    dtype = request.dtype or model_dtype(model)
    needs_budgets = request.device_map is None or request.page_cache is not None
    max_memory = get_max_memory(request.max_memory) if needs_budgets else {}
    headroom, memory = request.headroom, None
    if request.generation is not None and max_memory:
        held = hold_generation(model, dtype, request.no_split, device, max_memory, headroom, request.generation)
        max_memory, headroom, memory = held.max_memory, held.headroom, held.memory
    elif headroom is None:
        headroom = FORWARD_HEADROOM if max_memory else 0
        if headroom:
            check_headroom(max_memory, headroom, device)
    spec, drafted = request.speculative, {}
    if max_memory:
        generation = request.generation or Generation()
        max_memory, drafted = hold_speculation(spec, model, dtype, device_key(device), max_memory, headroom, generation)
    budgets = less_headroom(max_memory, headroom, device) if headroom else dict(max_memory)
    inputs = PlanInputs(
        placement=placement,
        storage=storage,
        policy=policy,
        execution_device=device,
        budgets=budgets,
        max_memory=max_memory,
        headroom=headroom,
        no_split=request.no_split,
        dtype=request.dtype,
        device_map=request.device_map,
        page_cache=request.page_cache,
        policy_name=request.policy_name,
        strict=request.device_map is None,
        over_budget=request.over_budget,
    )
    plan = make_plan(model, checkpoint, inputs)
    plan.held = held_beside_weights(memory, drafted)
    if spec.name == "self":
        remedy = "raise max_memory or lower the layers"
        check_self_resident(model, spec.layers, plan.device_map, device, "speculative='self'", remedy)
    return plan


def dispatch(
    plan: Plan,
    model: nn.Module,
    checkpoint: Checkpoint,
    offload_folder: str | Path | None = None,
    progress: bool = False,
) -> nn.Module:
    """Load the opened ``checkpoint`` into the empty ``model`` as ``plan`` says: its device map, store, policy (its
    buffers offloaded with the weights where it asks), no-split classes, dtype, execution device and kept set. The
    one door every caller with a plan dispatches by (``run.py``'s modes, a pipeline, :func:`from_pretrained`);
    ``offload_folder``: where a store that writes one writes it."""
    from offload_core.loading.dispatch import load_checkpoint_and_dispatch

    return load_checkpoint_and_dispatch(
        model,
        checkpoint,
        plan.device_map,
        no_split_module_classes=plan.no_split,
        offload_folder=offload_folder,
        dtype=plan.dtype,
        storage=plan.storage,
        policy=plan.policy,
        execution_device=plan.execution_device,
        progress=progress,
        offload_buffers=plan.policy.offload_buffers,
        residency=plan.residency(),
    )


def plan_and_dispatch(model: nn.Module, checkpoint: Checkpoint, request: PlanRequest) -> nn.Module:
    """Plan ``model`` (empty) for ``request`` (:func:`plan_request`) and load the opened ``checkpoint`` into it as
    the plan says (closing the checkpoint if that fails), prepared for the request's speculative decoding: what
    :func:`from_pretrained` does once the model is built. The plan is ``model.offload_plan``."""
    try:
        plan = plan_request(model, checkpoint, request)
        model = dispatch(plan, model, checkpoint, request.offload_folder, request.progress)
        model.speculation = prepare(request.speculative, model, request.dtype, request.execution_device)
        model.offload_plan = plan
        return model
    except BaseException:
        checkpoint.close()
        raise


def held_beside_weights(memory: Any, drafted: Mapping[str, int]) -> dict[str, int]:
    """What a plan holds back for the run beside its weights, by kind: the KV cache and activations of its
    generation (``memory``, a :class:`~offload_core.planning.batch_memory.BatchMemory` or None) and a draft's
    weights and KV cache (``drafted``)."""
    held = {"kv_cache": memory.kv_cache, "activations": memory.activations} if memory is not None else {}
    if drafted:
        held.update(draft_weights=drafted["weights"], draft_kv_cache=drafted["kv_cache"])
    return held
