"""The module hook of the prefetch policy: each unit's forward loads it from the prefetcher first and releases it
after."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from offload_core.module_hooks.base import ModuleHook, send_to_device

if TYPE_CHECKING:
    from offload_core.module_hooks.prefetch.prefetcher import Prefetcher


class PrefetchHook(ModuleHook):
    name = "prefetch_offload"

    def __init__(self, index: int, prefetcher: "Prefetcher", execution_device: torch.device) -> None:
        self.index = index
        self.prefetcher = prefetcher
        self.execution_device = execution_device
        # a CPU run computes every module on the CPU, where its inputs already are: nothing to walk through per call
        self.moves_inputs = execution_device.type != "cpu"

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        with torch.inference_mode(False):  # no inference tensors brought in, as in Unit.fetch
            self.prefetcher.load(self.index)
        if not self.moves_inputs:
            return args, kwargs
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.prefetcher.release(self.index)
        return output

    def on_error(self, module: nn.Module) -> None:
        self.prefetcher.release(self.index)

    def detach_hook(self, module: nn.Module) -> None:
        self.prefetcher.release(self.index)
