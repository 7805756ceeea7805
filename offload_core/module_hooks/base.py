"""The module-hook lifecycle (attach / pre_forward / post_forward / detach) and symmetric add/remove on a module.

Several module hooks on one module run in the order they were added for ``pre_forward`` and in
reverse order for ``post_forward`` (like nested context managers); ``call_forward`` lets a hook wrap
the call itself (the first hook added is the outermost). Names are unique per module.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
from torch import nn

_HOOKS = "_offload_module_hooks"
_OLD_FORWARD = "_offload_old_forward"
_HAD_INSTANCE_FORWARD = "_offload_had_instance_forward"


class ModuleHook:
    """Base class: override what you need. ``name`` must be unique among the hooks of one module."""

    name = "module_hook"

    def init_hook(self, module: nn.Module) -> None:
        """Called once when the hook is attached."""

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Called before ``forward``; may change its arguments."""
        return args, kwargs

    def call_forward(self, module: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """Runs ``forward``; override to wrap the call (the default calls it)."""
        return forward(*args, **kwargs)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called after ``forward``; may change its output."""
        return output

    def on_error(self, module: nn.Module) -> None:
        """Called when ``forward`` raised (Ctrl-C included): release what ``pre_forward`` took."""

    def detach_hook(self, module: nn.Module) -> None:
        """Called once when the hook is removed."""


class ForwardStartHook(ModuleHook):
    """On a model's root: ``action()`` runs as each forward pass starts (``name``: the hook's unique name)."""

    def __init__(self, name: str, action: Callable[[], None]) -> None:
        self.name = name
        self.action = action

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.action()
        return args, kwargs


class ModuleHookHandle:
    """Returned by :func:`add_hook_to_module`; ``remove()`` detaches exactly that hook."""

    def __init__(self, module: nn.Module, hook: ModuleHook) -> None:
        self.module = module
        self.hook = hook

    def remove(self) -> None:
        remove_hook_from_module(self.module, name=self.hook.name)


def module_hooks(module: nn.Module) -> list[ModuleHook]:
    """The module hooks attached to ``module``, in the order they were added."""
    return list(module.__dict__.get(_HOOKS, ()))


def add_hook_to_module(module: nn.Module, hook: ModuleHook) -> ModuleHookHandle:
    """Attach ``hook`` to ``module``; the wrapped ``forward`` keeps the original's name and signature."""
    hooks: list[ModuleHook] | None = module.__dict__.get(_HOOKS)
    if hooks is None:
        hooks = []
        had_instance_forward = "forward" in module.__dict__
        old_forward = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            return _run(module, hooks, old_forward, args, kwargs)

        functools.update_wrapper(forward, old_forward)
        module.__dict__[_HOOKS] = hooks
        module.__dict__[_OLD_FORWARD] = old_forward
        module.__dict__[_HAD_INSTANCE_FORWARD] = had_instance_forward
        module.forward = forward
    if any(h.name == hook.name for h in hooks):
        raise ValueError(f"module already has a module hook named {hook.name!r}; remove it first")
    hooks.append(hook)
    hook.init_hook(module)
    return ModuleHookHandle(module, hook)


def call_with_module_hooks(module: nn.Module, method: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``method`` (another entry of ``module``, such as a VAE's ``decode``) inside ``module``'s module hooks, as
    its ``forward`` is called."""
    return _run(module, list(module.__dict__.get(_HOOKS, ())), method, args, kwargs)


def _run(module: nn.Module, hooks: list[ModuleHook], old_forward: Callable, args: tuple, kwargs: dict) -> Any:
    current = list(hooks)
    started: list[ModuleHook] = []
    try:
        for hook in current:
            started.append(hook)
            args, kwargs = hook.pre_forward(module, args, kwargs)
        call = old_forward
        for hook in reversed(current):
            call = _wrap_call(hook, module, call)
        output = call(*args, **kwargs)
        for hook in reversed(current):
            output = hook.post_forward(module, output)
        return output
    except BaseException:
        for hook in reversed(started):
            hook.on_error(module)
        raise


def _wrap_call(hook: ModuleHook, module: nn.Module, inner: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        return hook.call_forward(module, inner, args, kwargs)

    return call


def remove_hook_from_module(module: nn.Module, name: str | None = None, recurse: bool = False) -> nn.Module:
    """Detach the hook called ``name`` (all hooks when ``None``); the last one gone restores ``forward``."""
    hooks: list[ModuleHook] | None = module.__dict__.get(_HOOKS)
    if hooks is not None:
        for hook in [h for h in reversed(hooks) if name is None or h.name == name]:
            hooks.remove(hook)
            hook.detach_hook(module)
        if not hooks:
            old_forward = module.__dict__.pop(_OLD_FORWARD)
            del module.__dict__[_HOOKS]
            if module.__dict__.pop(_HAD_INSTANCE_FORWARD):
                module.forward = old_forward
            else:
                del module.forward
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, name=name, recurse=True)
    return module


def send_to_device(
    obj: Any, device: torch.device, non_blocking: bool = False, skip_keys: frozenset = frozenset()
) -> Any:
    """Move every tensor inside tuples, lists and dicts to ``device``; other objects are left as they are."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(send_to_device(o, device, non_blocking, skip_keys) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(send_to_device(o, device, non_blocking, skip_keys) for o in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: v if k in skip_keys else send_to_device(v, device, non_blocking, skip_keys) for k, v in obj.items()}
    if isinstance(obj, dict) and _is_model_output(obj):  # transformers' outputs: a copy with its tensors moved
        moved = copy.copy(obj)
        for k, v in obj.items():
            if k not in skip_keys:
                moved[k] = send_to_device(v, device, non_blocking, skip_keys)
        return moved
    return obj


def _is_model_output(obj: Any) -> bool:
    return any(cls.__name__ == "ModelOutput" for cls in type(obj).__mro__)


def no_auto_compile(model: nn.Module) -> None:
    """Keep transformers' ``generate`` from compiling ``model``'s forward (it does so on its own for a static KV cache
    on a GPU): a compiled graph would trace the hooks' host-side work (reads, events, counters) and take its weights'
    addresses as fixed, which offloading and captured graphs change. Set on the model's generation config."""
    config = getattr(model, "generation_config", None)
    if config is not None:
        config.disable_compile = True
