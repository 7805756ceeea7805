"""Planning: sizes of a model's tensors and modules, memory budgets, and device maps that say where each weight
lives."""

from offload_core.planning.budgets import get_balanced_memory, get_max_memory
from offload_core.planning.device_map import (
    check_device_map,
    compress_device_map,
    device_of,
    normalize_device_map,
    summarize_device_map,
)
from offload_core.planning.fill import infer_auto_device_map, plan_device_map
from offload_core.planning.request import PlacementRequest
from offload_core.planning.sizing import (
    compute_module_sizes,
    find_tied_parameters,
    get_max_layer_size,
    largest_block_size,
    largest_module_size,
    named_module_tensors,
    no_split_classes,
    shared_modules,
    tensor_aliases,
    tie_groups,
)

__all__ = [
    "PlacementRequest",
    "check_device_map",
    "compress_device_map",
    "compute_module_sizes",
    "device_of",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "infer_auto_device_map",
    "largest_block_size",
    "largest_module_size",
    "named_module_tensors",
    "no_split_classes",
    "normalize_device_map",
    "plan_device_map",
    "shared_modules",
    "summarize_device_map",
    "tensor_aliases",
    "tie_groups",
]
