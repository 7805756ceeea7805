"""Where a weight sits in memory, as far as CPU kernels can tell: its address modulo :data:`ALIGNMENT`.

Some CPU kernels give results that depend on it (on AVX-512 machines, float32 matrix-vector products
sum in another order when the weight does not start on a 16-byte boundary). transformers' in-memory
load maps a safetensors checkpoint and uses the tensors it does not convert in place, at their offsets
in the file; what it converts or assembles it allocates afresh (aligned). To give the same results bit
for bit, an offloaded weight is handed to the model at the address offset its in-memory load gives it
(its *reference offset*, recorded when the tensor enters a store), wherever this machine's kernels care.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch

#: the address modulo that matters: at least the widest vector load (64 bytes for AVX-512)
ALIGNMENT = 64


def address_offset(tensor: torch.Tensor) -> int:
    """A CPU tensor's address modulo :data:`ALIGNMENT` (0 for an empty tensor, which has no bytes to read)."""
    return tensor.data_ptr() % ALIGNMENT if tensor.numel() and tensor.device.type == "cpu" else 0


def maps_checkpoint(model: torch.nn.Module) -> bool:
    """Whether ``model``'s in-memory load uses a checkpoint's tensors in place: transformers' ``from_pretrained``
    maps safetensors shards and keeps what it does not convert where it lies; any other module is loaded with
    ``load_state_dict``, which copies every tensor into new (aligned) memory."""
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def reference_offset(value: torch.Tensor, in_place: bool) -> int:
    """The reference offset of ``value``, a checkpoint tensor as read for the run (a mapped view, or a converted
    copy): its own where the in-memory load uses it in place (``in_place``), else 0."""
    return address_offset(value) if in_place else 0


#: the answer :func:`kernels_depend_on_alignment` gives for every dtype instead of probing (None: probe)
_assumed: bool | None = None


@contextmanager
def assume_kernels_depend_on_alignment(answer: bool) -> Iterator[None]:
    """Inside the block, :func:`kernels_depend_on_alignment` answers ``answer`` for every floating dtype instead of
    this machine's probe, in every thread: both paths (copy to the reference offset, or hand out in place) run on
    any machine. Not reentrant across threads: a test's seam, not a setting."""
    global _assumed
    previous, _assumed = _assumed, answer
    try:
        yield
    finally:
        _assumed = previous


def kernels_depend_on_alignment(dtype: torch.dtype) -> bool:
    """Whether this machine's CPU kernels give ``dtype`` products whose results depend on where the weight
    starts: a few matrix-vector and small matrix products, each with the weight at every element offset
    below :data:`ALIGNMENT`, compared bit for bit with the weight at an aligned address (probed once per dtype;
    :func:`assume_kernels_depend_on_alignment` answers instead)."""
    if not dtype.is_floating_point or dtype.itemsize >= ALIGNMENT:
        return False
    return _assumed if _assumed is not None else _probe(dtype)


@lru_cache(maxsize=None)
def _probe(dtype: torch.dtype) -> bool:
    """:func:`kernels_depend_on_alignment` measured on this machine."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows, cols, tokens in ((48, 64, 1), (160, 64, 1), (96, 40, 3)):
            weight = torch.randn(rows, cols, generator=generator).to(dtype)
            x = torch.randn(tokens, cols, generator=generator).to(dtype)
            want = torch.nn.functional.linear(x, weight)
            for offset in range(dtype.itemsize, ALIGNMENT, dtype.itemsize):
                if not torch.equal(
                    torch.nn.functional.linear(x, empty_at(weight.shape, dtype, offset).copy_(weight)), want
                ):
                    return True
    return False


def empty_at(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, offset: int, pin_memory: bool = False
) -> torch.Tensor:
    """A new CPU tensor whose address is ``offset`` modulo :data:`ALIGNMENT` (a multiple of the item size)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
    start = (offset - address_offset(raw)) % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).view(shape)


def misplaced(tensor: torch.Tensor, offset: int) -> bool:
    """Whether ``tensor`` must move to start at ``offset`` (modulo :data:`ALIGNMENT`) for this machine's kernels to
    compute with it as with the tensor at its reference offset."""
    return (
        tensor.device.type == "cpu"
        and tensor.numel() > 0
        and address_offset(tensor) != offset % ALIGNMENT
        and kernels_depend_on_alignment(tensor.dtype)
    )


def placed(tensor: torch.Tensor, offset: int) -> torch.Tensor:
    """``tensor`` itself unless it is :func:`misplaced`; then a copy that starts at ``offset``."""
    if not misplaced(tensor, offset):
        return tensor
    return empty_at(tensor.shape, tensor.dtype, offset).copy_(tensor)
