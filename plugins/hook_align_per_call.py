"""Built-in module-hook policy ``align_per_call``: bring a unit in before each call and drop it after, per owning module
or per block."""

from offload_core.hookspecs import hookimpl
from offload_core.module_hooks.align import AlignPerCall, AlignPerCallConfig


@hookimpl
def offload_register_module_hook_policies(register):
    register("align_per_call", AlignPerCall, AlignPerCallConfig)
