"""Tests of offload_core.planning: sizes, budgets, the fill algorithm, device maps and the built-in placements."""
