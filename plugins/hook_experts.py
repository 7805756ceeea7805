"""Built-in module-hook policy ``experts``: block-granular prefetch, with MoE experts read only where the router sends
tokens."""

from offload_core.hookspecs import hookimpl
from offload_core.module_hooks.experts import Experts, ExpertsConfig


@hookimpl
def offload_register_module_hook_policies(register):
    register("experts", Experts, ExpertsConfig)
