"""The :class:`Plan` and :func:`make_plan`: the plan made before anything is loaded, one rule for ``run.py``,
:func:`offload_core.from_pretrained` and the benchmarks: the bytes held back for units in flight, the device map (given,
the policy's own, or the placement's), its checks, the bytes predicted to move per token and the page-cache plan."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from offload_core import defaults
from offload_core.loading.gguf_moves import dequant_rows
from offload_core.loading.gguf_qcompute import quantized_lines
from offload_core.loading.moves import predicted_bytes_per_token, stored_bytes, stored_lines
from offload_core.loading.quantized import packed_lines
from offload_core.plan.held import budget_beside_held, held_bytes
from offload_core.registry.contracts import Placement, Policy, Storage
from offload_core.plan.limits import (
    check_disk_budget,
    check_memory_store_budget,
    check_own_map_budgets,
    check_reserve_in_budget,
)
from offload_core.storage.checkpoint import Checkpoint
from offload_core.storage.gguf.store import check_gguf
from offload_core.values import budget_key, format_size

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """Where every weight goes and what that costs: the checked device map, its per-device summary, the
    bytes held back per device for units in flight (``reserve``) and from the cpu budget (``headroom``),
    the largest no-split block, the bytes predicted to move per generated token, what converting the
    checkpoint's names to the model's costs (``conversion``: the report's lines) and the page-cache plan
    (:func:`offload_core.storage.residency.page_cache_plan`: kept and streamed bytes; empty: no kept set asked)."""

    device_map: dict[str, int | str]
    summary: dict[str, Any]
    reserve: dict[Any, int]
    headroom: int
    largest_block: int
    predicted_bytes_per_token: int
    conversion: list[str] = field(default_factory=list)
    page_cache: dict[str, Any] = field(default_factory=dict)
    #: offloaded tensors the policy brings in per forward, predicted as the bytes are (each costs a fixed time)
    predicted_loads_per_token: int = 0
    #: predicted_load_s, predicted_ttft_s, predicted_step_s (see :func:`offload_core.plan.predict.predict_time`)
    predicted_time: dict[str, float] = field(default_factory=dict)
    #: what re-dealing the placement's map by bytes read per token changed (:mod:`offload_core.planning.shares`)
    redealt: str = ""
    #: the policy the plan was made for: the one given, or it holding fewer units in flight (:func:`fit_in_flight`)
    policy: Policy | None = None
    #: what holding fewer units in flight changed (empty: nothing)
    lightened: str = ""
    #: what the run holds back beside its weights, by kind: ``kv_cache`` and ``activations`` of the generation it is
    #: planned for, a draft's ``draft_weights`` and ``draft_kv_cache`` (empty: none planned)
    held: dict[str, int] = field(default_factory=dict)
    #: the store the plan was made for (its ``reads_from`` and conversions priced the bytes moved)
    storage: Storage | None = None
    #: the device that computes, the no-split classes and the dtype the plan was made for: what dispatching it reads
    execution_device: torch.device | None = None
    no_split: list[str] = field(default_factory=list)
    dtype: torch.dtype | None = None
    #: per GGML type, what a store reading a GGUF file in place dequantizes per token
    #: (:func:`offload_core.loading.gguf_moves.dequant_rows`; the prediction adds ``predicted_s``); empty otherwise
    dequant: list[dict[str, Any]] = field(default_factory=list)
    #: ``auto``'s ranked configurations (``auto.json``'s rows), where it chose the store and policy; empty otherwise
    auto: list[dict[str, Any]] = field(default_factory=list)
    #: bytes the store holds in memory for the offloaded tensors where it holds them in fewer bytes than they compute
    #: in (:attr:`Storage.holds_stored`: out of the cpu budget, beside the resident tensors); None otherwise
    store_memory: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The plan's figures as ``RunResult.plan`` and ``plan_text`` take them."""
        return {
            "reserve": {str(k): v for k, v in self.reserve.items()},
            "headroom": self.headroom,
            "largest_block": self.largest_block,
            "predicted_bytes_per_token": self.predicted_bytes_per_token,
            "predicted_loads_per_token": self.predicted_loads_per_token,
            "conversion": list(self.conversion),
            "redealt": self.redealt,
            "lightened": self.lightened,
            "page_cache": self.page_cache,
            "store_memory": self.store_memory,
            **self.predicted_time,
        }

    def residency(self) -> Any:
        """The kept set the page-cache plan asks for (:func:`offload_core.storage.residency.make_residency`), or
        None."""
        from offload_core.storage.residency import make_residency

        return make_residency(self.page_cache)


@dataclass
class PlanInputs:
    """What :func:`make_plan` plans with beside the model and its checkpoint: the built strategies (``policy_name`` as
    the user named it, for the lines it prints), the device that computes, ``budgets`` (``max_memory`` less
    ``headroom`` on the device that computes, held back from the cpu budget on a CPU run), ``max_memory`` as the user
    gave it (None: ``budgets``; the summary and the disk limit read it), the no-split classes and dtype, a
    ``device_map`` that replaces the placement's (checked ``strict``ly unless it is the user's), the page-cache rule
    (None: no kept set) and what a budget the plan cannot hold does (``over_budget``)."""

    placement: Placement
    storage: Storage
    policy: Policy
    execution_device: torch.device
    budgets: Mapping[Any, int]
    no_split: list[str]
    dtype: torch.dtype | None
    max_memory: Mapping[Any, int] | None = None
    headroom: int = 0
    device_map: Mapping[str, int | str] | None = None
    page_cache: int | str | None = None
    policy_name: str = "?"
    strict: bool = True
    over_budget: str = defaults.OVER_BUDGET


def make_plan(model: nn.Module, checkpoint: Checkpoint, inputs: PlanInputs) -> Plan:
    """The plan of the empty ``model`` loaded from the opened ``checkpoint``: ``device_map`` when given, else the
    policy's own (checked against ``budgets``), else the placement's within ``budgets`` less what the policy keeps
    in flight. ``max_memory``: the budgets as the user gave them (``budgets`` is that less ``headroom`` on the
    device that computes, held back from the cpu budget on a CPU run); the summary and the disk limit read it.
    ``page_cache`` None plans no kept set. A budget that cannot hold what the policy keeps in flight (a block larger
    than it): ``over_budget="warn"`` runs over it, a warning line saying by how much; ``"refuse"`` refuses the plan in
    one line."""
    from offload_core.loading.conversion import key_conversion
    from offload_core.plan.reserve import Reserver
    from offload_core.loading.routes import route_tensors
    from offload_core.planning import (
        PlacementRequest,
        check_device_map,
        largest_block_size,
        normalize_device_map,
        summarize_device_map,
    )
    from offload_core.planning.shares import redeal_by_reads
    from offload_core.storage.residency import page_cache_plan

    placement, storage, policy, policy_name = inputs.placement, inputs.storage, inputs.policy, inputs.policy_name
    execution_device, no_split, dtype, device_map = (
        inputs.execution_device,
        inputs.no_split,
        inputs.dtype,
        inputs.device_map,
    )
    headroom, page_cache = inputs.headroom, inputs.page_cache
    budgets = dict(inputs.budgets)
    max_memory = dict(budgets if inputs.max_memory is None else inputs.max_memory)
    if storage.reads_gguf:  # before any budget is worked out for a store that cannot read this checkpoint
        check_gguf(checkpoint)
    block = largest_block_size(model, no_split, dtype=dtype)
    device_budget = budgets.get(budget_key(execution_device)) if execution_device.type != "cpu" else None
    reserve_of = Reserver.of(
        model, checkpoint, storage, execution_device, no_split, dtype, budgets.get("cpu"), device_budget
    )

    def offloaded(device_map: Mapping[str, int | str]) -> dict[str, str]:
        return route_tensors(model, device_map, execution_device, policy.offload_buffers).offloaded

    def place(held: dict[Any, int], within: Mapping[Any, int] | None = None) -> tuple[dict[str, int | str], Any]:
        within = budgets if within is None else within
        request = PlacementRequest(
            model=model,
            max_memory=within,
            no_split_module_classes=no_split,
            dtype=dtype,
            special_dtypes=None,
            reserve=held,
        )
        made = normalize_device_map(placement.make_device_map(request))
        redeal = redeal_by_reads(model, made, policy.read_shares(model), execution_device, within, held, dtype)
        return (made if redeal is None else normalize_device_map(redeal.device_map)), redeal

    redeal = None
    own = device_map is None and (device_map := policy.own_device_map(model, execution_device)) is not None
    placed = device_map is None
    stored = stored_bytes(checkpoint, storage, dtype)
    if placed and storage.holds_stored and execution_device.type == "cpu" and "cpu" in budgets:
        budgets["cpu"] = budget_beside_held(
            budgets["cpu"], lambda cpu: held_bytes(offloaded(place({}, {**budgets, "cpu": cpu})[0]).values(), stored)
        )
    if placed:  # what is in flight depends on what the map offloads, and the map on what is held back
        policy, reserve, lightened, (device_map, redeal) = settle_in_flight(
            policy, budgets, place, lambda p, made: reserve_of(p, offloaded(made)), reserve_of
        )
    device_map = normalize_device_map(dict(device_map))
    check_device_map(model, device_map, strict=inputs.strict)
    moved = offloaded(device_map)
    if not placed:  # a map given, or the policy's own: what it offloads is known
        policy, reserve, lightened = fit_in_flight(policy, budgets, lambda p: reserve_of(p, moved))
    check_reserve_in_budget(reserve, budgets, max_memory, block, policy_name, inputs.over_budget)
    summary = summarize_device_map(model, device_map, max_memory, dtype=dtype)
    if own:
        check_own_map_budgets(summary, budgets, max_memory, reserve, policy, policy_name, model, execution_device)
    cpu_headroom = headroom if execution_device.type == "cpu" else 0
    check_disk_budget(summary, max_memory, block, cpu_headroom)
    store_memory = held_bytes(moved.values(), stored) if storage.holds_stored else None
    held_cpu = reserve.get("cpu", 0) + cpu_headroom
    check_memory_store_budget(summary, storage, max_memory, held_cpu, store_memory, inputs.over_budget)
    predicted = predicted_bytes_per_token(model, device_map, policy, execution_device, dtype, no_split, stored=stored)
    loads = predicted_bytes_per_token(model, device_map, policy, execution_device, dtype, no_split, count=True)
    conversion = key_conversion(model, checkpoint)
    lines = conversion.summary().lines()
    if copies := reserve_of.copies_of(moved):
        lines.append(
            f"{format_size(copies)} of the parts lie at other page offsets than the rest of their tensor "
            f"(edges, a shard boundary): copied once, held back from the cpu budget"
        )
    lines += stored_lines(checkpoint, stored, summary, device_map, model, execution_device, storage.holds_stored)
    lines += packed_lines(model, dtype)
    lines += quantized_lines(checkpoint, device_map, model, execution_device)
    if store_memory is not None:
        lines.append(
            f"held in memory in stored bytes: {format_size(store_memory)} for the offloaded tensors, out of the cpu "
            f"budget (the resident tensors planned within the {format_size(budgets.get('cpu', 0))} left of it)"
        )
    dequant = (
        dequant_rows(model, device_map, policy, execution_device, dtype, no_split, checkpoint, stored)
        if storage.reads_gguf
        else []
    )
    if conversion.converted:
        names = sorted(conversion.converted)
        lines.append("converted: " + ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else ""))
    kept = (
        {}
        if page_cache is None or storage.holds_stored  # nothing of the files read as it runs: no kept set to plan
        else page_cache_plan(
            page_cache,
            summary,
            execution_device,
            policy.keeps_page_cache,
            max_memory.get("cpu", 0),
            block,
            # a GGUF file's pages hold the quantized blocks: kept and read in the file's bytes
            offloaded=held_bytes(moved.values(), stored) if storage.reads_gguf and stored else None,
        )
    )
    redealt = redeal.line() if redeal is not None else ""
    return Plan(
        device_map,
        summary,
        reserve,
        headroom,
        block,
        predicted,
        lines,
        kept,
        loads,
        redealt=redealt,
        policy=policy,
        lightened=lightened,
        storage=storage,
        execution_device=execution_device,
        no_split=list(no_split),
        dtype=dtype,
        dequant=dequant,
        store_memory=store_memory,
    )


#: device maps a plan tries at most for one that holds back what its policy holds for the units it offloads, before
#: it holds back what the policy would hold were every tensor offloaded
SETTLE_ROUNDS = 8


def settle_in_flight(
    policy: Policy,
    budgets: Mapping[Any, int],
    place: Callable[[dict[Any, int]], tuple[dict[str, int | str], Any]],
    reserve_for_map: Callable[[Policy, dict[str, int | str]], dict[Any, int]],
    reserve_bound: Callable[[Policy], dict[Any, int]],
) -> tuple[Policy, dict[Any, int], str, tuple[dict[str, int | str], Any]]:
    """The policy, its reservation, what lightening it changed (:func:`fit_in_flight`) and what ``place`` gave (the
    device map first) for a map made with the bytes held back (``place(held)``) that hold what the policy holds for
    the units that map offloads (``reserve_for_map(policy, device_map)``). A map made holding nothing back comes
    first: where it offloads nothing, nothing is in flight and the plan holds nothing back. Otherwise each map is
    made holding back the most any map before it needed, until what the last one needs is held; after
    :data:`SETTLE_ROUNDS` maps, what the policy would hold were every tensor offloaded (``reserve_bound``)."""
    held: dict[Any, int] = {}
    placed = place(held)
    for _ in range(SETTLE_ROUNDS):
        device_map = placed[0]
        chosen, reserve, lightened = fit_in_flight(policy, budgets, lambda p: reserve_for_map(p, device_map))
        if all(size <= held.get(dev, 0) for dev, size in reserve.items()):
            return chosen, reserve, lightened, placed
        held = {dev: max(held.get(dev, 0), reserve.get(dev, 0)) for dev in {*held, *reserve}}
        placed = place(held)
    chosen, reserve, lightened = fit_in_flight(policy, budgets, reserve_bound)
    return chosen, reserve, lightened, place(reserve)


def fit_in_flight(
    policy: Policy, budgets: Mapping[Any, int], reserve_of: Callable[[Policy], dict[Any, int]]
) -> tuple[Policy, dict[Any, int], str]:
    """The policy to plan with, its reservation and a line saying what changed: where what ``policy`` holds in flight
    (``reserve_of(policy)``) is over a device's budget, the policy holding fewer (:meth:`Policy.lighter`, one step at a
    time) as far as brings every device it can under its budget. A budget is a limit the run keeps; how far a policy
    reads ahead is only its speed. A device that no lighter policy brings under stays over (the plan then warns by how
    much), and where none helps the policy is as given."""

    def over(held: dict[Any, int]) -> set[Any]:
        return {dev for dev, size in held.items() if dev in budgets and size > budgets[dev]}

    reserve = reserve_of(policy)
    steps: list[tuple[Policy, str, dict[Any, int]]] = []
    lighter = policy.lighter() if over(reserve) else None
    while lighter is not None:
        steps.append((*lighter, reserve_of(lighter[0])))
        lighter = lighter[0].lighter()
    if not steps or over(steps[-1][2]) >= over(reserve):
        return policy, reserve, ""
    stuck = over(steps[-1][2])
    candidate, changed, held = next(step for step in steps if over(step[2]) <= stuck)
    dev = sorted(over(reserve) - stuck, key=str)[0]
    return (
        candidate,
        held,
        f"{changed}: the units in flight as configured take {format_size(reserve[dev])} on {dev}, over the "
        f"{format_size(budgets[dev])} max_memory.{dev} leaves for weights; now {format_size(held[dev])}",
    )
