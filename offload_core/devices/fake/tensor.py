"""Tensors on the fake accelerator: CPU tensors wearing a ``fakegpu:N`` device.

``fakegpu`` is torch's PrivateUse1 backend renamed, with a Python device guard, so ``torch.device("fakegpu", 1)``,
``tensor.to("fakegpu:1")``, ``torch.empty(..., device=...)`` and modules' ``.to()`` work as they do for a
GPU. A :class:`FakeTensor` holds its values in a CPU tensor (``elem``); every operation on it runs on the
CPU, checked as a GPU would check it (all operands on one device), issued on the current fake stream
(:class:`~offload_core.devices.fake.timeline.Timeline`) and counted against the device's memory.
Functions whose decomposition depends on the device type (attention, linear, matmul, rms_norm) run
whole on the CPU tensors, so results equal the CPU model's bit for bit.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

BACKEND = "fakegpu"

#: run whole on the CPU values: their decomposition into aten operations depends on the device type
HOST_COMPOSITES = {
    torch.nn.functional.scaled_dot_product_attention,
    torch.nn.functional.linear,
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
}
#: the operations (aten names, and the composites above) that run on cuBLAS and take its workspace
MATRIX_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "addmv", "mv", *HOST_COMPOSITES}
MATRIX_PRODUCTS.discard(torch.nn.functional.scaled_dot_product_attention)
if hasattr(torch.nn.functional, "rms_norm"):
    HOST_COMPOSITES.add(torch.nn.functional.rms_norm)

#: operations a GPU accepts with CPU tensors among the operands
CROSS_DEVICE = {"copy_", "_to_copy", "index", "index_put_", "_index_put_impl_", "_copy_from", "_copy_from_and_resize"}

_runtime: Any = None  # the installed FakeAccelerator (bookkeeping); None: tensors still work, untracked
_registered = False
_register_lock = threading.Lock()


def set_runtime(runtime: Any) -> None:
    global _runtime
    _runtime = runtime


def _index(device: Any) -> torch.device:
    device = torch.device(device)
    return torch.device(BACKEND, 0 if device.index is None else device.index)


def is_fake_device(device: Any) -> bool:
    return device is not None and not isinstance(device, (int, torch.dtype)) and torch.device(device).type == BACKEND


class FakeTensor(torch.Tensor):
    """A tensor on a fake device; ``elem`` holds its values on the CPU."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device, requires_grad: bool = False) -> "FakeTensor":
        # A normal tensor even under inference mode (a view of one must share its version counter); autograd
        # and inference mode act on the wrappers, the values below them are computed under inference mode.
        with torch.inference_mode(False):
            wrapper = torch.Tensor._make_wrapper_subclass(
                cls,
                elem.size(),
                strides=elem.stride(),
                storage_offset=elem.storage_offset(),
                dtype=elem.dtype,
                device=device,
                requires_grad=requires_grad,
            )
        wrapper.elem = elem
        return wrapper

    def __init__(self, elem: torch.Tensor, device: torch.device, requires_grad: bool = False) -> None:
        runtime = _runtime
        if runtime is not None:
            runtime.adopt(self, elem, device)

    def __del__(self) -> None:
        held = self.__dict__.get("_fake_block")
        if held is not None:
            runtime, ptr, index = held
            runtime.drop_wrapper(ptr, index)

    def __tensor_flatten__(self):
        return ["elem"], self.device

    @staticmethod
    def __tensor_unflatten__(inner, device, outer_size, outer_stride):
        return FakeTensor(inner["elem"], device)

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"FakeTensor({self.elem!r}, device='{self.device}')"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_COMPOSITES:
            return _on_host(func, args, kwargs)
        if func is torch.Tensor.tolist:  # a copy to the host, as on a GPU
            return args[0].cpu().tolist()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})


def _wrap(value: Any, device: torch.device) -> Any:
    return tree_map(
        lambda t: FakeTensor(t, device) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t, value
    )


def _storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _devices(flat: list) -> tuple[set, list]:
    fakes = {t.device for t in flat if isinstance(t, FakeTensor)}
    hosts = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.dim() > 0]
    return fakes, hosts


def _same_device(name: str, fakes: set, hosts: list) -> torch.device:
    if len(fakes) > 1 or (hosts and name not in CROSS_DEVICE):
        shown = sorted(str(d) for d in fakes) + (["cpu"] if hosts else [])
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{shown[0]} and {shown[1]}! (fake accelerator, {name})"
        )
    return next(iter(fakes))


def _unwrap(value: Any) -> Any:
    def one(t):
        if isinstance(t, FakeTensor):
            return t.elem
        if isinstance(t, torch.device) and t.type == BACKEND:
            return torch.device("cpu")
        return t

    return tree_map(one, value)


def _operate(device, reads, writes, run, what, deferred=False):
    runtime = _runtime
    if runtime is None:
        return None if deferred else run()
    return runtime.timeline.operate(device, reads, writes, run, what, deferred)


def _on_host(func, args, kwargs):
    flat, _ = tree_flatten((args, kwargs))
    fakes, hosts = _devices(flat)
    device = _same_device(getattr(func, "__name__", str(func)), fakes, hosts)
    reads = [_storage_ptr(t.elem) for t in flat if isinstance(t, FakeTensor)]
    a, k = _unwrap(args), _unwrap(kwargs)
    if func in MATRIX_PRODUCTS and _runtime is not None:
        _runtime.take_workspace(device)

    def run():
        with torch._C.DisableTorchFunctionSubclass(), torch.inference_mode():
            return func(*a, **k)

    return _wrap(_operate(device, reads, [], run, getattr(func, "__name__", "function")), device)


def _written(func, args, kwargs) -> list:
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += [t for t in tree_flatten(value)[0] if isinstance(t, FakeTensor)]
    return out


def _copy_from_host(dst: "FakeTensor", src: torch.Tensor, non_blocking: bool) -> None:
    """A host-to-device copy: queued when asynchronous from pinned memory (a real DMA runs later and reads the
    source then), else done now."""
    runtime = _runtime
    deferred = bool(non_blocking and runtime is not None and runtime.is_pinned(src))
    if not deferred:
        _operate(
            dst.device, [], [_storage_ptr(dst.elem)], lambda: _compute(dst.elem.copy_, (src,), {}), "copy to the device"
        )
        return
    snapshot = src.clone()
    target = dst.elem

    def run():
        if not torch.equal(src, snapshot):
            runtime.timeline.hazard(
                "a pinned host buffer was rewritten before the asynchronous copy reading it ran "
                "(wait for its event before reusing it)"
            )
        _compute(target.copy_, (src,), {})

    _operate(dst.device, [], [_storage_ptr(target)], run, "asynchronous copy to the device", deferred=True)


def dispatch(func, args, kwargs):
    """Every aten operation with a fake tensor among its operands (and the fake backend's own kernels)."""
    name = func._schema.name.split("::")[-1]
    if func is torch.ops.aten._to_copy.default:
        return _to_copy(args[0], kwargs)
    if name == "copy_":
        dst, src = args[0], args[1]
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if isinstance(dst, FakeTensor) and not isinstance(src, FakeTensor):
            if src.device.type != "cpu":
                raise RuntimeError(f"fake accelerator: cannot copy from {src.device}")
            _copy_from_host(dst, src, non_blocking)
            return dst
        if not isinstance(dst, FakeTensor):  # device to host: the host waits for it
            _operate(
                src.device,
                [_storage_ptr(src.elem)],
                [],
                lambda: _compute(dst.copy_, (src.elem,), {}),
                "copy to the host",
            )
            return dst
    flat, _ = tree_flatten((args, kwargs))
    fakes, hosts = _devices(flat)
    target = kwargs.get("device")
    if not fakes:  # a factory for a fake device (the backend's kernels)
        device = _index(target)
        a, k = _unwrap(args), {**_unwrap(kwargs), "pin_memory": False} if "pin_memory" in kwargs else _unwrap(kwargs)
        elem = func(*a, **k)
        if _runtime is not None and _runtime.timeline.capture is not None and not name.startswith("empty"):
            _runtime.timeline.capture.factory(device, _runtime.timeline.current(device), elem, lambda: func(*a, **k))
        return _wrap(_fresh(elem, device), device)
    device = _same_device(name, fakes, hosts)
    if target is not None and is_fake_device(target):
        device = _index(target)
    if func.is_view:  # metadata only: no stream work, no access to the bytes
        a, k = _unwrap(args), _unwrap(kwargs)
        with torch.inference_mode():
            out = func(*a, **k)
        if _runtime is not None and _runtime.timeline.capture is not None:  # ``to`` may convert: made again on replay
            reads = [_storage_ptr(t.elem) for t in flat if isinstance(t, FakeTensor)]
            _runtime.timeline.capture.view(device, _runtime.timeline.current(device), reads, out, lambda: func(*a, **k))
        return _wrap(out, device)
    writes = [_storage_ptr(t.elem) for t in _written(func, args, kwargs)]
    reads = [_storage_ptr(t.elem) for t in flat if isinstance(t, FakeTensor)]
    a, k = _unwrap(args), _unwrap(kwargs)
    if name == "histc" and not a[0].is_floating_point():  # a GPU counts integers; the CPU kernel wants floats
        a = (a[0].float(), *a[1:])
    if name in MATRIX_PRODUCTS and _runtime is not None:
        _runtime.take_workspace(device)
    out = _operate(device, reads, writes, lambda: _compute(func, a, k), name)
    # an in-place operation returns its own operand
    if isinstance(out, torch.Tensor) and writes and args and isinstance(args[0], FakeTensor) and out is args[0].elem:
        return args[0]
    return _wrap(out, device)


def _compute(func, args, kwargs):
    with torch.inference_mode():
        return func(*args, **kwargs)


def _fresh(elem: torch.Tensor, device: torch.device) -> torch.Tensor:
    """New device memory holds garbage: NaN bytes, so a read before the copy that fills it shows."""
    if elem.numel():
        elem.untyped_storage().fill_(255)
    return elem


def _to_copy(src: torch.Tensor, kwargs: dict) -> torch.Tensor:
    target = kwargs.get("device")
    non_blocking = bool(kwargs.get("non_blocking", False))
    rest = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking", "pin_memory")}
    if isinstance(src, FakeTensor):
        if target is None or is_fake_device(target):
            device = _index(target) if target is not None else src.device
            ptr = _storage_ptr(src.elem)
            out = _operate(
                device if device == src.device else src.device,
                [ptr],
                [],
                lambda: torch.ops.aten._to_copy.default(src.elem, **rest),
                "copy on the device",
            )
            return FakeTensor(out, device)
        return _operate(
            src.device,
            [_storage_ptr(src.elem)],
            [],
            lambda: torch.ops.aten._to_copy.default(src.elem, **rest),
            "copy to the host",
        )
    device = _index(target)
    converted = torch.ops.aten._to_copy.default(src, **rest) if rest else src
    dst = FakeTensor(_fresh(torch.empty_like(converted), device), device)
    _copy_from_host(dst, converted, non_blocking and converted is src)
    return dst


_KERNELS = [
    "empty_strided",
    "empty.memory_format",
    "_to_copy",
    "copy_",
    "_copy_from",
    "_copy_from_and_resize",
    "view",
    "as_strided",
    "_reshape_alias",
    "alias",
    "detach",
    "resize_",
    "_local_scalar_dense",
    "fill_.Scalar",
    "zero_",
    "t",
    "transpose.int",
    "expand",
    "slice.Tensor",
    "select.int",
    "unsqueeze",
    "squeeze.dim",
    "clone",
    "contiguous",
    "_unsafe_view",
    "index.Tensor",
    "cat",
]


def _op(name: str):
    op = torch.ops.aten
    base, _, overload = name.partition(".")
    packet = getattr(op, base)
    return getattr(packet, overload or "default")


class _BackendModule:
    """``torch.fakegpu``: what torch asks a backend module."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return _runtime is not None

    def current_device(self) -> int:
        return 0

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        return None

    def device_count(self) -> int:
        return _runtime.count() if _runtime is not None else 0

    def _lazy_init(self) -> None:
        return None


def register_backend() -> None:
    """Rename PrivateUse1 to ``fakegpu`` with a Python device guard, and give it the kernels that operations
    reach with the Python dispatch key excluded (``torch.tensor(..., device=...)``). Once per process."""
    global _registered
    with _register_lock:
        if _registered:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(BACKEND, backend_module=_BackendModule())
        library = torch.library.Library("aten", "IMPL")
        for name in _KERNELS:
            op = _op(name)
            library.impl(name, lambda *args, _op=op, **kwargs: dispatch(_op, args, kwargs), "PrivateUse1")
        _LIBRARIES.append(library)
        _registered = True


_LIBRARIES: list = []
