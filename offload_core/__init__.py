"""offload_core: run models that do not fit in accelerator memory or RAM by planning where every weight lives and
streaming offloaded weights around each module's forward.

Importing this package loads no plugin; the registry is built on first use.
"""

# first: drops optional libraries' import-time noise before anything imports transformers (see its IMPORT_NOISE)
import offload_core.loading.quiet  # noqa: F401, I001
from offload_core.loading.cpu_offload import cpu_offload_with_hook
from offload_core.loading.dispatch import dispatch_model, load_checkpoint_and_dispatch
from offload_core.loading.empty import init_empty_weights, init_on_device
from offload_core.errors import OffloadError
from offload_core.loading.hub import Hub
from offload_core.module_hooks.align import AlignDevicesHook
from offload_core.module_hooks.base import ModuleHook, add_hook_to_module, remove_hook_from_module
from offload_core.options import Offload
from offload_core.pretrained import from_pretrained
from offload_core.planning import (
    check_device_map,
    compute_module_sizes,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
    infer_auto_device_map,
)
from offload_core.values import parse_size

__version__ = "0.1.0"

__all__ = [
    "AlignDevicesHook",
    "Hub",
    "ModuleHook",
    "Offload",
    "OffloadError",
    "add_hook_to_module",
    "check_device_map",
    "compute_module_sizes",
    "cpu_offload_with_hook",
    "dispatch_model",
    "find_tied_parameters",
    "from_pretrained",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "parse_size",
    "remove_hook_from_module",
]
