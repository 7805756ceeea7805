"""Tests of offload_core.registry: the plugin manager and the contract checks every built-in strategy passes."""
