"""A pipeline's activations, planned before anything is loaded: one call of the empty pipeline, in which each module
component runs on fake tensors (shapes and dtypes, no data, no compute) while the pipeline's own code (tokenizers,
scheduler, latents) runs as it does, on zeros standing in for each component's output. The peak of the bytes alive
inside a component's call, its inputs included, is what the run holds back beside the weights."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import platform
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from offload_core.loading.pipeline import ENTRY_METHODS, EmptyPipeline
from offload_core.planning.headroom import FORWARD_HEADROOM, runtime_slack
from offload_core.values import format_size

logger = logging.getLogger(__name__)

#: glibc's ``mallopt`` parameter: allocations from this size up get their own mapping, unmapped when freed
M_MMAP_THRESHOLD = -3
#: from the moment a pipeline is built, allocations from 1 MiB up are mapped apart and unmapped when freed (glibc's
#: threshold otherwise grows to 32 MiB): building a 2 GB pipeline's components grew the heap by 0.7 GB, and the
#: weights loaded next and the activations after them fragmented it: a prefetch run held 0.72-0.83 GB of anonymous
#: memory against a 0.69 GB budget, 0.59-0.61 GB with this threshold (and 0.66-0.74 GB with it set back to 32 MiB
#: once loaded, 9.0-9.5 s an image against 10.3-10.6 s: activations' pages are faulted in anew each step)
PIPELINE_MMAP_THRESHOLD = 1 << 20
#: operators whose CPU kernels hold their input and output again beside them while they run (oneDNN reorders a
#: convolution's NCHW tensors into its blocked layout): a VAE's decoder at 256x256 peaked 1.2-1.3x the tensors
#: alone (0.44-0.46 GB measured against 0.35 GB traced), 0.53 GB with them counted
SCRATCH_OPS = ("convolution",)


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the bytes of the storages alive that the operators inside it made, and their peak: a storage is
    counted once however many views hold it, and freed when the last of them is."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # storage -> [tensors holding it, its bytes]

    def _hold(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        entry = self._storages.get(storage._cdata)
        if entry is None:
            entry = self._storages[storage._cdata] = [0, storage.nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(tensor, self._release, storage._cdata)

    def _release(self, key: int) -> None:
        entry = self._storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._storages[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._hold, out)
        if func.overloadpacket.__name__ in SCRATCH_OPS and isinstance(out, torch.Tensor):
            self.peak = max(self.peak, self.live + _bytes(args[0]) + _bytes(out))
        return out


def _bytes(tensor: Any) -> int:
    return tensor.untyped_storage().nbytes() if isinstance(tensor, torch.Tensor) else 0


def _signature(args: Any) -> tuple:
    """What a component's output shapes depend on: its tensors' shapes and dtypes, and its other arguments (numbers
    by type only: a timestep given as a number changes each step, the shapes do not)."""

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return tuple(value.shape), value.dtype
        if isinstance(value, (bool, str, type(None))):
            return value
        return type(value).__name__

    return tuple(map(leaf, tree_leaves(args)))


class ActivationTrace:
    """The components' calls traced on fake tensors; ``peak`` the largest (inside one call, its inputs counted)."""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.peak = 0
        self._outputs: dict[tuple, Any] = {}
        self._inside = False

    def wrap(self, name: str, method: Callable) -> Callable:
        """``method`` of component ``name``, run on fake tensors once per signature; zeros of its outputs' shapes."""

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._inside:  # a component's method calling another of its own (a VAE's forward calls decode)
                return method(*args, **kwargs)
            key = (name, method.__name__, _signature((args, kwargs)))
            if key not in self._outputs:
                inputs = sum(map(_bytes, tree_leaves((args, kwargs))))
                live = LiveBytes()
                self._inside = True
                try:
                    with self.fake, live, torch.no_grad():
                        self._outputs[key] = method(*args, **kwargs)
                finally:
                    self._inside = False
                self.peak = max(self.peak, inputs + live.peak)
            return tree_map_only(torch.Tensor, _zeros_like, self._outputs[key])

        return call

    @contextlib.contextmanager
    def fake_weights(self, modules: nn.Module) -> Iterator[None]:
        """The empty components' meta weights as fake cpu tensors while the trace runs; meta again after it."""
        saved: list[tuple[dict, str, Any]] = []
        with self.fake:
            for module in modules.modules():
                for table in (module._parameters, module._buffers):
                    for key, tensor in table.items():
                        if tensor is not None and tensor.device.type == "meta":
                            saved.append((table, key, tensor))
                            fake = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                            table[key] = (
                                nn.Parameter(fake, requires_grad=False) if table is module._parameters else fake
                            )
        try:
            yield
        finally:
            for table, key, tensor in saved:
                table[key] = tensor


def _zeros_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.zeros(tensor.shape, dtype=tensor.dtype)


def trace_activations(empty: EmptyPipeline, call: dict[str, Any]) -> int:
    """The bytes the pipeline's ``call`` (its keyword arguments) holds at its peak beside the weights, traced on the
    empty pipeline, which is left as it was. Raises what the pipeline raises where it cannot run on fake tensors
    (the caller falls back to a fixed headroom)."""
    pipeline, trace = empty.pipeline, ActivationTrace()
    patched = []
    scheduler = copy.deepcopy(getattr(pipeline, "scheduler", None))
    bar = copy.deepcopy(getattr(pipeline, "_progress_bar_config", None))
    try:
        for name, module in empty.modules.named_children():
            for method in ("forward", *ENTRY_METHODS):
                original = getattr(module, method, None)
                if callable(original):
                    module.__dict__[method] = trace.wrap(name, original)
                    patched.append((module, method))
        pipeline.set_progress_bar_config(disable=True)
        with trace.fake_weights(empty.modules), _quiet(), torch.no_grad():
            pipeline(**call)
    finally:
        for module, method in patched:
            module.__dict__.pop(method, None)
        if scheduler is not None:
            pipeline.scheduler = scheduler
        if bar is None:
            pipeline.__dict__.pop("_progress_bar_config", None)
        else:
            pipeline._progress_bar_config = bar
    return trace.peak


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """diffusers' and transformers' warnings (a prompt truncated) silenced: the run itself says them."""
    import diffusers
    import transformers

    levels = diffusers.logging.get_verbosity(), transformers.logging.get_verbosity()
    diffusers.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers.logging.set_verbosity(levels[0])
        transformers.logging.set_verbosity(levels[1])


def default_call() -> dict[str, Any]:
    """The call planned for when none is given (``from_pretrained``): one image of the pipeline's default size."""
    return {"prompt": "a", "num_inference_steps": 2, "output_type": "pt"}


def pipeline_headroom(
    empty: EmptyPipeline, call: dict[str, Any], budget: int | None, device: torch.device | str | None = None
) -> int:
    """What a pipeline run holds back from the ``budget`` of the ``device`` it computes on (CPU or GPU): the
    activations of ``call`` traced on the empty pipeline, and a pipeline's runtime slack (a GPU's workspace in it);
    a pipeline that cannot be traced gets the fixed headroom of a forward instead, and a warning line saying so. At
    most half the budget (a warning line when it is capped): the weights keep the other half."""
    try:
        activations = trace_activations(empty, call)
    except Exception as error:  # any pipeline code that cannot run on fake tensors: planned with a fixed allowance
        reason = (str(error).strip().splitlines() or [""])[0][:160]
        logger.warning(
            "could not trace the pipeline's activations (%s: %s); holding back %s for them: give headroom=<size> "
            "to hold more",
            type(error).__name__,
            reason,
            format_size(FORWARD_HEADROOM),
        )
        activations = FORWARD_HEADROOM
    needed = activations + runtime_slack(budget, device, pipeline=True)
    if budget is not None and needed > budget // 2:
        logger.warning(
            "the pipeline's activations and runtime (%s) are over half of its budget (%s): holding back half, so the "
            "run may go over it; raise max_memory, or give headroom=<size>",
            format_size(needed),
            format_size(budget),
        )
        return budget // 2
    return needed


def mmap_threshold(nbytes: int) -> bool:
    """Under glibc, allocations of ``nbytes`` and more from now on get their own mapping, returned to the system
    when freed, unless free memory in its heap serves them (a fixed threshold: glibc's own grows); whether it was
    set (False on another C library)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False
