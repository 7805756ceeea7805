"""What a dispatched model answers for ``model.device``: the execution device where its first weight is offloaded.

transformers takes a model's device from its first parameter. Offloaded, that parameter is on ``meta`` between
calls, and ``generate`` would then decide as if the model ran on an accelerator (a Mixture-of-Experts model
switches its experts to ``batched_mm`` for decoding) or build tensors on ``meta``. The in-memory model it must
equal reports the device it runs on; so does the dispatched one.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn


def report_execution_device(model: nn.Module, execution_device: torch.device) -> None:
    """Make ``model.device`` name ``execution_device`` whenever the model's first parameter is offloaded (on
    ``meta`` between calls, or resting on the cpu while the model runs on an accelerator); a first parameter
    resident on an accelerator names its own device, as it does in memory.

    Only models whose class has a ``device`` property (transformers models) are changed; the class is swapped
    for a subclass of the same name, undone by :func:`restore_device_report`.
    """
    cls = type(model)
    if isinstance(getattr(cls, "device", None), property) and not getattr(cls, "_offload_core_reports_device", False):
        model.__class__ = _reporting_class(cls)
    model._offload_core_execution_device = torch.device(execution_device)


def restore_device_report(model: nn.Module) -> None:
    """Give ``model`` back its own class (after the module hooks are removed)."""
    cls = type(model)
    if getattr(cls, "_offload_core_reports_device", False):
        model.__class__ = cls.__bases__[0]
    model.__dict__.pop("_offload_core_execution_device", None)


@lru_cache(maxsize=None)
def _reporting_class(cls: type) -> type:
    def device(self) -> torch.device:
        first = next(self.parameters()).device
        return self._offload_core_execution_device if first.type in ("meta", "cpu") else first

    return type(
        cls.__name__,
        (cls,),
        {
            "device": property(device, doc=cls.device.__doc__),
            "_offload_core_reports_device": True,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        },
    )
