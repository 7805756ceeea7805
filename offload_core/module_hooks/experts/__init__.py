"""experts: expert-granular offload for MoE models; only the experts the router selected are read, a few stay
cached, the next layer's are guessed ahead."""

from offload_core.module_hooks.experts.cache import ExpertCache
from offload_core.module_hooks.experts.lists import expert_lists
from offload_core.module_hooks.experts.loader import ExpertCounters, ExpertLayer, is_fused_experts, read_expert
from offload_core.module_hooks.experts.policy import Experts, ExpertsConfig, ExpertsHandle
from offload_core.module_hooks.experts.rows import ReservedRows, RowsLayer

__all__ = [
    "ExpertCache",
    "ExpertCounters",
    "ExpertLayer",
    "Experts",
    "ExpertsConfig",
    "ExpertsHandle",
    "ReservedRows",
    "RowsLayer",
    "expert_lists",
    "is_fused_experts",
    "read_expert",
]
