"""Built-in module-hook policy ``functional_call``: offloaded tensors passed to torch.func.functional_call for one call,
as vLLM does."""

from offload_core.hookspecs import hookimpl
from offload_core.module_hooks.functional import FunctionalCall, FunctionalCallConfig


@hookimpl
def offload_register_module_hook_policies(register):
    register("functional_call", FunctionalCall, FunctionalCallConfig)
