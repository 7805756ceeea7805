"""Built-in module-hook policy ``prefetch``: block-granular offload with look-ahead along the recorded execution
order."""

from offload_core.hookspecs import hookimpl
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig


@hookimpl
def offload_register_module_hook_policies(register):
    register("prefetch", Prefetch, PrefetchConfig)
