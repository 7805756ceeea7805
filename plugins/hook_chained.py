"""Built-in module-hook policy ``chained``: the model's blocks chained in execution order, each kept loaded until the
next is called."""

from offload_core.hookspecs import hookimpl
from offload_core.module_hooks.chained import Chained, ChainedConfig


@hookimpl
def offload_register_module_hook_policies(register):
    register("chained", Chained, ChainedConfig)
