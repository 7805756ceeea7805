"""Tests of offload_core.module_hooks: the module-hook lifecycle and every built-in policy."""
