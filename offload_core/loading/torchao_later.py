"""torchao imported when a run needs it, not at every process's start: transformers imports torchao's safetensors
support (a second or more of a cold start, most of it torchao's own import) as soon as it imports its quantizers,
which every model load does; only a torchao checkpoint uses it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any

#: transformers' torchao quantizer, which imports torchao at its import when torchao is installed
QUANTIZER = "transformers.quantizers.quantizer_torchao"


def flatten_tensor_state_dict(*args: Any, **kwargs: Any) -> Any:
    """torchao's ``flatten_tensor_state_dict`` (what transformers' quantizer saves a torchao model's weights with),
    imported at its first call."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict as flatten

    return flatten(*args, **kwargs)


class _Later(importlib.abc.MetaPathFinder):
    """Finds :data:`QUANTIZER` as Python does and runs its module with transformers seeing torchao absent; the module
    then gets the real availability check back, and :func:`flatten_tensor_state_dict` for the one name it would have
    imported: every method of it behaves as before, torchao is imported by what uses it (transformers' torchao
    integration, our packed loading)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != QUANTIZER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            import transformers.utils as utils

            available = getattr(utils, "is_torchao_available", None)
            if available is None:  # another transformers: imported as it is
                run(module)
                return
            utils.is_torchao_available = lambda *args, **kwargs: False
            try:
                run(module)
            finally:
                utils.is_torchao_available = available
            module.is_torchao_available = available
            if not hasattr(module, "flatten_tensor_state_dict"):
                module.flatten_tensor_state_dict = flatten_tensor_state_dict

        spec.loader.exec_module = exec_module
        return spec


def import_torchao_later() -> None:
    """From now on transformers' quantizers import without importing torchao (once; nothing when torchao is not
    installed or the quantizer is already imported)."""
    if QUANTIZER in sys.modules or any(isinstance(finder, _Later) for finder in sys.meta_path):
        return
    if importlib.util.find_spec("torchao") is None:
        return
    sys.meta_path.insert(0, _Later())
