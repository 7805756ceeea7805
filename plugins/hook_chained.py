"""Built-in module-hook policy ``chained``: seed 000's cpu_offload_with_hook applied to the model's blocks in execution order."""

from offload_core.hookspecs import hookimpl
from offload_core.module_hooks.chained import Chained, ChainedConfig


@hookimpl
def offload_register_module_hook_policies(register):
    register("chained", Chained, ChainedConfig)
