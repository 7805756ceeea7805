"""Stores hold offloaded tensors; module-hook policies read them by name (a lazy ``Mapping[str, Tensor]``)."""

from offload_core.storage.base import Store, StoreContext, convert_dtype

__all__ = ["Store", "StoreContext", "convert_dtype"]
