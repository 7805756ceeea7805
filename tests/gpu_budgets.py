"""GPU budgets for the tests on a real device: the bytes a test means for the model and its generation, plus what
every run holds back whole on that device beside them (the math libraries' workspace: cuBLAS keeps 32 MiB on an H100
or H200, which does not shrink with the budget)."""

from __future__ import annotations

from offload_core import devices


def on_gpu(nbytes: int, index: int = 0) -> int:
    """``max_memory[index]`` that leaves ``nbytes`` to the plan on CUDA device ``index``."""
    return devices.for_device(f"cuda:{index}").workspace_bytes(index) + nbytes
