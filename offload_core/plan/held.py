"""The cpu budget of a plan whose store holds the offloaded tensors in memory in fewer bytes than they compute in
(``storage=gguf storage.resident=quantized``: their quantized blocks): the resident tensors fill what the held bytes of
the tensors the map offloads leave of the budget, so that more of the model fits it."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

#: how close the search comes to the largest budget that fits (bytes)
STEP = 1 << 20


def held_bytes(keys: Iterable[str], stored: Mapping[str, int]) -> int:
    """Bytes the store holds for the offloaded store ``keys`` (each once: tied tensors share one)."""
    return sum(stored.get(key, 0) for key in set(keys))


def budget_beside_held(budget: int, held_for: Callable[[int], int], step: int = STEP) -> int:
    """The largest budget ``c`` for the resident tensors (within ``step``) such that ``c`` and the bytes held for what a
    map made within ``c`` offloads (``held_for(c)``) fit ``budget`` together: ``budget`` itself where the map offloads
    nothing, 0 where even the whole model held does not fit (the plan then says by how much it is over)."""
    if held_for(budget) == 0:
        return budget
    if held_for(0) > budget:
        return 0
    low, high = 0, budget
    while high - low > step:
        middle = (low + high) // 2
        if middle + held_for(middle) <= budget:
            low = middle
        else:
            high = middle
    return low
