"""The one reservation rule the runner and the Python API share: the bytes a placement holds back for the policy's
units in flight, given the model, the checkpoint, the store and where the run executes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
from torch import nn

from offload_core.module_hooks.policy import Policy
from offload_core.planning.reservation import InFlight
from offload_core.storage.base import Storage
from offload_core.storage.checkpoint import Checkpoint
from offload_core.values import budget_key


def reservation(policy: Policy, storage: Storage, need: InFlight, converts: bool = False) -> dict[Any, int]:
    """Bytes the placement must hold back for the units in flight: the policy's answer (its ``reserve``) to ``need``
    (the units' sizes, the model, the budgets; see :class:`InFlight`) completed with what the storage declares
    (``converts_on_read``: a checkpoint dtype other than the run's (``converts``) makes copies on read; ``pinned``: no
    staging needed for a GPU; ``decode_scratch``; whether it hands out views)."""
    scratch = storage.decode_scratch and storage.decode_scratch_for(largest_tensor(need.model, need.offloaded))
    need = replace(
        need,
        store_converts=(converts and storage.converts_on_read) or scratch > 0,
        store_pinned=storage.pinned,
        store_scratch=scratch,
        experts_scratch=storage.decode_scratch_for(largest_expert(need.model)) if storage.decodes_experts else 0,
        store_maps=storage.reads_from in ("offload_folder", "checkpoint", "memory"),
    )
    return dict(policy.reserve(need))


@dataclass(frozen=True)
class Reserver:
    """What a placement holds back for a policy's units in flight, all but the policy worked out once (a plan asks it
    for the policy as given and for each lighter one, and for each device map it tries): ``model``'s largest no-split
    block, its largest module, whether any tensor is stored otherwise than the model holds it (another dtype, or
    several checkpoint tensors; ``copied``: which), and the spliced tensors' copies (:func:`splice_copies`; ``spliced``:
    per tensor), held back from the cpu budget. Held back on the devices the policy names only, so a large embedding
    never keeps a whole model off the cpu tier. Called with the tensors a map offloads, it sizes the units made of
    those alone; a map that offloads nothing holds nothing back."""

    model: nn.Module
    storage: Storage
    execution_device: torch.device
    no_split: list[str]
    dtype: torch.dtype | None
    cpu_budget: int | None
    block: int
    module_bytes: int
    stored_differs: bool
    copies: int
    copied: frozenset[str] = frozenset()
    spliced: Mapping[str, int] | None = None
    device_budget: int | None = None

    @classmethod
    def of(
        cls,
        model: nn.Module,
        checkpoint: Checkpoint,
        storage: Storage,
        execution_device: torch.device,
        no_split: list[str],
        dtype: torch.dtype | None,
        cpu_budget: int | None = None,
        device_budget: int | None = None,
    ) -> Reserver:
        from offload_core.loading.conversion import key_conversion
        from offload_core.planning import largest_block_size, largest_module_size
        from offload_core.storage.base import converts

        # A tensor stored in another dtype, or built from several checkpoint tensors (per-expert MoE weights),
        # is a copy when a store that reads in place hands it out; unless it is only placement of safetensors
        # parts, which the store maps where they lie (storage.splice), wherever the kernels ignore alignment.
        converted = key_conversion(model, checkpoint).converted
        stored_differs = (
            checkpoint.is_gguf  # a GGUF file's tensors are dequantized into copies as they are read
            or any(converts(checkpoint.dtype(k), dtype) for k in checkpoint.keys())
            or (bool(converted) and not splices(checkpoint, converted, dtype))
            or (execution_device.type == "cpu" and copies_to_reference_offsets(model, checkpoint, dtype))
        )
        spliced = splice_copies_by_name(model, checkpoint, storage, dtype)
        return cls(
            model,
            storage,
            execution_device,
            no_split,
            dtype,
            cpu_budget,
            block=largest_block_size(model, no_split, dtype=dtype),
            module_bytes=largest_module_size(model, dtype=dtype),
            stored_differs=stored_differs,
            copies=sum(spliced.values()),
            copied=copied_names(model, checkpoint, execution_device, dtype) if stored_differs else frozenset(),
            spliced=spliced,
            device_budget=device_budget,
        )

    def __call__(self, policy: Policy, offloaded: Mapping[str, str] | None = None) -> dict[Any, int]:
        """What ``policy`` holds back for the units made of ``offloaded`` (name -> store key, as
        :func:`offload_core.loading.routes.route_tensors` gives them; None: every tensor, a bound for any map)."""
        block, module, differs, copies = self.block, self.module_bytes, self.stored_differs, self.copies
        copied = None
        if offloaded is not None:
            block = largest_unit(self.model, offloaded, self.no_split, "block", self.dtype)
            module = largest_unit(self.model, offloaded, [], "module", self.dtype)
            copied = self.copied.intersection(offloaded) if self.storage.converts_on_read else frozenset()
            differs = bool(copied)
            copies = self.copies_of(offloaded)
        need = InFlight(
            self.execution_device,
            block,
            module,
            model=self.model,
            dtype=self.dtype,
            cpu_budget=self.cpu_budget,
            no_split_module_classes=tuple(self.no_split or ()),
            offloaded=offloaded,
            copied=copied,
            device_budget=self.device_budget,
        )
        reserve = reservation(policy, self.storage, need, differs)
        if self.storage.pools_copies:  # the units in flight are pool buffers, and the pool keeps one of each size
            reserve["cpu"] = max(reserve.get("cpu", 0), pooled_bytes(self.model, offloaded, self.dtype))
        if copies:
            reserve["cpu"] = reserve.get("cpu", 0) + copies
        if offloaded is not None and not offloaded:  # nothing is in flight where nothing is offloaded
            return {dev: 0 for dev in reserve}
        return reserve

    def copies_of(self, offloaded: Mapping[str, str]) -> int:
        """The spliced copies the store holds where ``offloaded`` are the tensors offloaded."""
        return sum(size for name, size in (self.spliced or {}).items() if name in offloaded)


def largest_expert(model: nn.Module | None) -> int | None:
    """Elements of one expert's rows of the largest fused expert tensor of ``model`` (what a pass decoding a routed
    expert takes); None without a model."""
    from offload_core.module_hooks.experts.loader import is_fused_experts

    if model is None:
        return None
    rows = [
        tensor[0].numel()
        for module in model.modules()
        if is_fused_experts(module)
        for tensor in module.parameters(recurse=False)
        if tensor.dim() == 3
    ]
    return max(rows, default=0)


def largest_tensor(model: nn.Module | None, offloaded: Mapping[str, str] | None) -> int | None:
    """Elements of the largest of ``offloaded``'s tensors (None: every tensor of ``model``); None without a model."""
    if model is None:
        return None
    tensors = model.state_dict(keep_vars=True).items()
    return max((t.numel() for name, t in tensors if offloaded is None or name in offloaded), default=0)


def pooled_bytes(model: nn.Module, offloaded: Mapping[str, str] | None, dtype: torch.dtype | None) -> int:
    """What a store that keeps its copies for reuse by size (:attr:`Storage.pools_copies`) holds when each size was
    in use once: one tensor of each size (element count and dtype, in the run's ``dtype``) of ``offloaded`` (None:
    of every tensor)."""
    sizes: dict[tuple[int, torch.dtype], int] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if offloaded is None or name in offloaded:
            kind = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            sizes[(tensor.numel(), kind)] = tensor.numel() * kind.itemsize
    return sum(sizes.values())


def largest_unit(
    model: nn.Module, offloaded: Mapping[str, str], no_split: list[str], granularity: str, dtype: torch.dtype | None
) -> int:
    """Bytes of the largest unit a policy of ``granularity`` makes of the ``offloaded`` tensors
    (:func:`offload_core.module_hooks.units.find_units`), each store key once: the blocks or modules it brings in."""
    from offload_core.module_hooks.units import find_units
    from offload_core.planning.sizing import tensor_bytes

    largest = 0
    for unit in find_units(model, offloaded, no_split, granularity):
        tensors = {slot.key: slot.original for slot in unit.slots}
        largest = max(largest, sum(tensor_bytes(tensor, dtype) for tensor in tensors.values()))
    return largest


def copied_names(
    model: nn.Module, checkpoint: Checkpoint, execution_device: torch.device, dtype: torch.dtype | None
) -> frozenset[str]:
    """The names of ``model``'s tensors that a store reading ``checkpoint`` in place hands out as copies: stored in
    another dtype, built from several checkpoint tensors and not spliced (:func:`splices`), or, on a CPU run, at an
    offset the kernels would compute otherwise on (:func:`copies_to_reference_offsets`)."""
    from offload_core.alignment import ALIGNMENT, kernels_depend_on_alignment, maps_checkpoint
    from offload_core.loading.conversion import key_conversion
    from offload_core.storage.base import converts

    if checkpoint.is_gguf:  # every tensor dequantized (or processed) into a copy as it is read
        return frozenset(model.state_dict(keep_vars=True))
    conversion = key_conversion(model, checkpoint)
    keys = set(checkpoint.keys())
    misplaced = execution_device.type == "cpu" and not maps_checkpoint(model) and checkpoint.is_safetensors

    def moved(key: str) -> bool:
        kind = dtype if dtype is not None and checkpoint.dtype(key).is_floating_point else checkpoint.dtype(key)
        start = checkpoint.safetensors_file(checkpoint.file_of(key)).byte_range(key)[0]
        return bool(start % ALIGNMENT) and kernels_depend_on_alignment(kind)

    copied = set()
    for name in model.state_dict(keep_vars=True):
        item = conversion.converted.get(name)
        sources = (
            list(item.sources)
            if item is not None
            else [key]
            if (key := conversion.renamed.get(name, name)) in keys
            else []
        )
        if (
            any(converts(checkpoint.dtype(key), dtype) for key in sources)
            or (item is not None and not maps_in_place(checkpoint, item, dtype))
            or (item is None and misplaced and any(moved(key) for key in sources))
        ):
            copied.add(name)
    return frozenset(copied)


def maps_in_place(checkpoint: Checkpoint, item: Any, dtype: torch.dtype | None) -> bool:
    """Whether a store reading ``checkpoint`` in place hands out the tensor assembled from ``item``'s parts as the
    parts' own mapped pages (:class:`offload_core.storage.splice.Spliced`): its parts only placed, and, on a machine
    whose kernels depend on where a weight starts, the address its pages give it aligned as the in-memory tensor's
    (assembled afresh: offset 0)."""
    from pathlib import Path

    from offload_core.alignment import ALIGNMENT, kernels_depend_on_alignment
    from offload_core.storage.splice import Part, lead_of

    if not (checkpoint.is_safetensors and item.parts is not None):
        return False
    kind = checkpoint.dtype(item.parts[0][0])
    if dtype is None or not kernels_depend_on_alignment(kind):
        return True
    parts = [
        Part(
            index, Path(checkpoint.file_of(key)), *checkpoint.safetensors_file(checkpoint.file_of(key)).byte_range(key)
        )
        for key, index in item.parts
    ]
    lead = lead_of(torch.Size(item.shape), kind, parts)
    return lead is not None and lead % ALIGNMENT == 0


def splices(checkpoint: Checkpoint, converted: dict[str, Any], dtype: torch.dtype | None) -> bool:
    """Whether a store reading ``checkpoint`` in place maps the ``converted`` tensors where their parts lie
    (:mod:`offload_core.storage.splice`): safetensors parts that are only placed, on kernels that ignore alignment."""
    from offload_core.alignment import kernels_depend_on_alignment

    return (
        checkpoint.is_safetensors
        and all(item.parts is not None for item in converted.values())
        and not (dtype is not None and kernels_depend_on_alignment(dtype))
    )


def splice_copies(model: nn.Module, checkpoint: Checkpoint, storage: Storage, dtype: torch.dtype | None) -> int:
    """Bytes ``storage`` holds as copies for the tensors it splices from ``checkpoint``'s parts, were every assembled
    tensor offloaded (:func:`splice_copies_by_name`)."""
    return sum(splice_copies_by_name(model, checkpoint, storage, dtype).values())


def splice_copies_by_name(
    model: nn.Module, checkpoint: Checkpoint, storage: Storage, dtype: torch.dtype | None
) -> dict[str, int]:
    """Bytes ``storage`` holds as copies for each tensor it splices from ``checkpoint``'s parts, should it be offloaded
    (:func:`offload_core.storage.splice.copied_bytes`: edges, and the parts that lie in another shard than most of
    their tensor's bytes); none for a store that does not read the checkpoint in place. ``checkpoint``: the opened
    checkpoint, or one already converted to the model's names (``load_checkpoint_and_dispatch`` passes that)."""
    from pathlib import Path

    from offload_core.loading.conversion import key_conversion
    from offload_core.loading.converted import ConvertedCheckpoint
    from offload_core.storage.base import converts
    from offload_core.storage.splice import Part, copied_bytes

    if isinstance(checkpoint, ConvertedCheckpoint):  # the opened checkpoint, whose names are the parts'
        checkpoint = checkpoint.checkpoint
    converted = key_conversion(model, checkpoint).converted
    if storage.reads_from != "checkpoint" or not checkpoint.is_safetensors:
        return {}
    shapes = {name: tensor.shape for name, tensor in model.state_dict(keep_vars=True).items()}
    copies = {}
    for name, item in converted.items():  # the store splices every one it does not convert, wherever it computes
        if item.parts and name in shapes and not converts(checkpoint.dtype(item.parts[0][0]), dtype):
            parts = [
                Part(
                    index,
                    Path(checkpoint.file_of(key)),
                    *checkpoint.safetensors_file(checkpoint.file_of(key)).byte_range(key),
                )
                for key, index in item.parts
            ]
            copies[name] = copied_bytes(shapes[name], checkpoint.dtype(item.parts[0][0]), parts)
    return copies


def copies_to_reference_offsets(model: nn.Module, checkpoint: Checkpoint, dtype: torch.dtype | None) -> bool:
    """Whether a store reading ``checkpoint`` in place must copy some tensor to hand it to a CPU run: the in-memory
    load copies every tensor to an aligned address (a model not loaded by mapping, a diffusers component), the
    tensor lies at another offset in its file, and this machine's kernels depend on where a weight starts
    (:func:`offload_core.alignment.misplaced`, decided before anything is mapped)."""
    from offload_core.alignment import ALIGNMENT, kernels_depend_on_alignment, maps_checkpoint

    if maps_checkpoint(model) or not checkpoint.is_safetensors:
        return False
    for key in checkpoint.keys():
        kind = dtype if dtype is not None and checkpoint.dtype(key).is_floating_point else checkpoint.dtype(key)
        start = checkpoint.safetensors_file(checkpoint.file_of(key)).byte_range(key)[0]
        if start % ALIGNMENT and kernels_depend_on_alignment(kind):
            return True
    return False


def units_in_flight(policy: Policy | None, execution_device: torch.device) -> int:
    """How many units ``policy`` (None: one) holds on the execution device at once, read from its own
    :meth:`~offload_core.module_hooks.policy.Policy.reserve` for units of one byte that are copies."""
    if policy is None:
        return 1
    need = InFlight(execution_device, block_bytes=1, module_bytes=1, store_converts=True)
    key = budget_key(execution_device)
    return max(1, int(policy.reserve(need).get(key, 1)))


def whole_limit(budgets: Mapping[Any, int], device: torch.device, policy: Policy | None = None) -> int | None:
    """The largest component (or block) that moves whole: the execution device's budget shared by the units the
    policy holds in flight at once and what runs beside them (half of it for a policy holding one unit); None
    (any) when that device has no budget."""
    key = budget_key(device)
    budget = budgets.get(key)
    if budget is None:
        return None
    return budget // (units_in_flight(policy, device) + 1)
