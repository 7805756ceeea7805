"""Built-in module-hook policy ``align_per_call``: seed 000's AlignDevicesHook, per owning module or per block."""

from offload_core.hookspecs import hookimpl
from offload_core.module_hooks.align import AlignPerCall, AlignPerCallConfig


@hookimpl
def offload_register_module_hook_policies(register):
    register("align_per_call", AlignPerCall, AlignPerCallConfig)
