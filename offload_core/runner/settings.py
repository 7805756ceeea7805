"""Typed config schemas in Hydra's ConfigStore: the run, the model presets, and one option per registered strategy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from offload_core.registry.manager import Registry, get_registry


@dataclass
class ModelConfig:
    """Which checkpoint to run. ``path`` (any local Hugging Face checkpoint folder) wins over ``name``."""

    #: smollm2 (embedded default), synthetic (random Llama of a preset size) or local (needs path)
    name: str = "smollm2"
    path: Optional[str] = None
    #: synthetic only: tiny, small, 0.3b, 1.1b, 30b
    preset: str = "tiny"
    #: apply the tokenizer's chat template to the prompt
    chat_template: bool = True
    #: module classes never split across devices (default: the model's own ``_no_split_modules``)
    no_split_module_classes: Optional[List[str]] = None


@dataclass
class RunConfig:
    """Top-level keys of ``conf/config.yaml``."""

    placement: Any = MISSING
    storage: Any = MISSING
    hook: Any = MISSING
    model: ModelConfig = MISSING
    prompt: str = "What is the capital of France?"
    max_new_tokens: int = 16
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    #: budget per device: {"cpu": "200MiB", "0": "10GiB"}; sizes are strings or bytes
    max_memory: Dict[str, Any] = field(default_factory=lambda: {"cpu": "200MiB"})
    #: held back from the cpu budget for activations, KV cache and logits on a CPU run
    headroom: str = "48MiB"
    #: auto (the checkpoint's), float32, bfloat16, float16
    dtype: str = "auto"
    #: where the memmap store writes (a temporary folder, removed at exit, when null)
    offload_folder: Optional[str] = None
    #: a JSON device map to use instead of the placement's
    device_map: Optional[str] = None
    #: cpu, cuda, cuda:N (default: cuda:0 when present, else cpu)
    execution_device: Optional[str] = None
    seed: int = 0
    #: also run the model fully in memory and record whether the tokens match
    compare_in_memory: bool = False
    #: print the plan (device map, bytes per device, reservation) and stop before loading anything
    plan_only: bool = False
    progress: bool = True


MODEL_PRESETS = {
    "smollm2": ModelConfig(name="smollm2"),
    "synthetic": ModelConfig(name="synthetic", preset="tiny", chat_template=False),
    "local": ModelConfig(name="local", path=MISSING),
}


def register_configs(registry: Registry | None = None) -> ConfigStore:
    """Store the run schema, the model presets and every registered strategy's config dataclass."""
    registry = registry or get_registry()
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for name, node in MODEL_PRESETS.items():
        cs.store(group="model", name=name, node=node)
    for kind in ("placement", "storage", "hook"):
        for name in registry.names(kind):
            cs.store(group=kind, name=name, node=registry.get(kind, name).config)
    return cs
