"""The decoding step as a graph: a module hook on the model's root that runs a one-token step with a static KV cache
eagerly once, captures the next such step and replays it for every token after, its inputs copied into fixed
buffers first."""

from __future__ import annotations

import copy
import logging
import os
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from offload_core.module_hooks.base import ModuleHook

log = logging.getLogger(__name__)


def _cache_of(args: tuple, kwargs: dict) -> Any:
    """The KV cache among the call's arguments (a transformers ``Cache``), or None."""
    for value in [*args, *kwargs.values()]:
        if hasattr(value, "layers") and hasattr(value, "get_seq_length"):
            return value
    return None


def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]


def _where(error: BaseException) -> str:
    """Where ``error`` was raised, as ``file:line in function``: its innermost frame outside torch and the device
    layer (the model's or a hook's line that asked for what a capture cannot hold)."""
    inside = (str(Path(torch.__file__).parent) + os.sep, str(Path(__file__).parents[2] / "devices") + os.sep)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(inside)]
    if not frames:
        return "inside torch"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


def _tokens(args: tuple, kwargs: dict) -> torch.Tensor | None:
    ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    return ids if isinstance(ids, torch.Tensor) else None


class DecodeGraphs(ModuleHook):
    """Captures and replays one-token decoding steps with a static (compileable) KV cache; any other call (a
    prompt, a dynamic cache) runs eagerly. The first decoding step runs eagerly, as the warm-up; the next is
    captured, then replayed; a step whose cache, shapes or options differ from the captured one is captured again
    (one graph at a time: its pool is freed when the next is captured)."""

    name = "decode_graphs"

    def __init__(self, accelerator: Any, device: torch.device, ring: Any = None) -> None:
        self.accelerator = accelerator
        self.device = device
        self.ring = ring
        self.key: Any = None
        self.graph: Any = None
        self.inputs: Any = None  # the static copies of the step's tensors
        self.output: Any = None
        self.captures = 0
        self.replays = 0
        self.eager_steps = 0
        self.failed: str | None = None  # why a capture failed: decoding goes on eagerly

    def _key(self, args: tuple, kwargs: dict, cache: Any) -> Any:
        def sign(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return ("tensor", tuple(value.shape), value.dtype, str(value.device))
            if value is cache:
                return ("cache", id(cache), tuple(t.data_ptr() for t in _cache_tensors(cache)))
            return ("value", repr(value))

        return tuple(sign(a) for a in args), tuple((k, sign(v)) for k, v in sorted(kwargs.items()))

    def call_forward(self, module: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        cache = _cache_of(args, kwargs)
        ids = _tokens(args, kwargs)
        decoding = (
            cache is not None
            and getattr(cache, "is_compileable", False)
            and ids is not None
            and ids.dim() == 2
            and ids.shape[1] == 1
            and kwargs.get("inputs_embeds") is None
        )
        if not decoding or self.failed is not None:
            return forward(*args, **kwargs)
        key = self._key(args, kwargs, cache)
        if key != self.key:  # a new cache or new shapes
            self._drop()
            self.key = key
            if not self.eager_steps:  # the first decoding step runs eagerly (the warm-up: lazy initializations) ...
                self.eager_steps += 1
                return forward(*args, **kwargs)
        if self.graph is None:  # ... and the next one (and a new cache's first) is captured
            try:
                self._capture(forward, args, kwargs, cache)
            except Exception as error:  # a capture runs nothing: this step, and the ones after, run eagerly
                self.failed = f"{type(error).__name__}: {error}".splitlines()[0] + f" at {_where(error)}"
                self._drop()
                log.warning(
                    "graphs: capturing a decoding step failed (%s); decoding goes on without graphs", self.failed
                )
                return forward(*args, **kwargs)
        static_args, static_kwargs = self.inputs
        pairs = [*zip(static_args, args), *((static_kwargs[name], value) for name, value in kwargs.items())]
        for static, value in pairs:
            if isinstance(static, torch.Tensor) and static is not value:
                static.copy_(value)
        self.accelerator.replay(self.graph)
        self.replays += 1
        if self.ring is not None:
            self.ring.replayed()
        return self._fresh_output()

    def _capture(self, forward: Callable, args: tuple, kwargs: dict, cache: Any) -> None:
        def static(value: Any) -> Any:
            return value.clone() if isinstance(value, torch.Tensor) else value

        self.inputs = [static(a) for a in args], {name: static(v) for name, v in kwargs.items()}
        graph = self.accelerator.new_graph()
        a, k = self.inputs
        with self.accelerator.graph_capture(graph, self.device):
            self.output = forward(*a, **k)
        self.graph = graph
        self.captures += 1

    def _fresh_output(self) -> Any:
        """The captured output with its tensors copied out of the graph's buffers (the next replay rewrites them)."""
        out = self.output
        if isinstance(out, torch.Tensor):
            return out.clone()
        if hasattr(out, "items"):
            fresh = copy.copy(out)
            for name, value in out.items():
                if isinstance(value, torch.Tensor):
                    fresh[name] = value.clone()
            return fresh
        return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, out)

    def counters(self) -> dict[str, int]:
        return {
            "graph_captures": self.captures,
            "graph_replays": self.replays,
            "graph_eager_steps": self.eager_steps,
            "graph_failed": int(self.failed is not None),
        }

    def _drop(self) -> None:
        """Let the graph go, once the work reading its pool (the last outputs' copies) is done."""
        if self.graph is not None:
            self.accelerator.synchronize(self.device)
        self.key = self.graph = self.inputs = self.output = None

    def detach_hook(self, module: nn.Module) -> None:
        self._drop()
