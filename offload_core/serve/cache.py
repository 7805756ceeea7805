"""The KV cache of the requests generating together, left-padded to one width: rows that join are padded to it (or it
to them), rows that leave are dropped, and columns no row needs any more are cut, all between forwards. Each layer
keeps its keys and values in buffers with room for the columns to come, so a decoding step writes its one column
instead of copying the whole cache (transformers' dynamic layer concatenates every step)."""

from __future__ import annotations

import functools
from typing import Any

import torch


def _layers(cache: Any) -> list[Any]:
    return list(cache.layers)


@functools.cache
def _room_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class RoomLayer(DynamicLayer):
        """A dynamic layer whose ``keys`` and ``values`` are views of buffers with room for more columns (up to
        ``limit`` in all): a step writes its columns into the room; a buffer is made anew (the room doubling, as a
        list grows) only when full or when ``keys`` was replaced (rows joined, left or were cut)."""

        limit = 0

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.is_initialized or self.keys.numel() == 0:
                self.lazy_initialization(key_states, value_states)
                self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
                self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
            width, new = self.keys.shape[-2], key_states.shape[-2]
            if not self._fits(width + new):
                room = max(width + new, min(2 * (width + new), self.limit))
                self.buffers = tuple(_roomy(t, room) for t in (self.keys, self.values))
            keys, values = self.buffers
            keys[:, :, width : width + new] = key_states
            values[:, :, width : width + new] = value_states
            self.keys, self.values = keys[:, :, : width + new], values[:, :, : width + new]
            return self.keys, self.values

        def _fits(self, width: int) -> bool:
            """``keys`` and ``values`` are still the leading columns of the buffers, which hold ``width`` columns."""
            if self.buffers is None:
                return False
            return all(
                t.data_ptr() == b.data_ptr()
                and t.shape[:2] == b.shape[:2]
                and t.stride() == b.stride()
                and b.shape[-2] >= width
                for t, b in zip((self.keys, self.values), self.buffers)
            )

    return RoomLayer


def _roomy(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    """An empty buffer of ``columns`` columns, ``tensor`` in its leading ones."""
    shape = list(tensor.shape)
    shape[-2] = columns
    buffer = tensor.new_empty(shape)
    buffer[:, :, : tensor.shape[-2]] = tensor
    return buffer


def with_room(cache: Any, limit: int) -> Any:
    """``cache`` (a fresh transformers dynamic cache) with each full-sequence layer replaced by one that writes new
    columns into room kept for them, at most ``limit`` columns in all (the context a request holds)."""
    from transformers.cache_utils import DynamicLayer

    kind = _room_layer_class()
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = kind()
            cache.layers[i].limit = limit
    return cache


def check_mergeable(cache: Any) -> None:
    """Rows of ``cache`` can be padded, joined and dropped: every layer holds the whole sequence (no sliding window)."""
    from transformers.cache_utils import DynamicLayer

    kinds = {
        type(layer).__name__
        for layer in _layers(cache)
        if type(layer) is not DynamicLayer and type(layer) is not _room_layer_class()
    }
    if kinds:
        raise TypeError(f"layers of kind {', '.join(sorted(kinds))} cannot be batched across requests")


def _pad_left(tensor: torch.Tensor, columns: int, dim: int) -> torch.Tensor:
    if columns <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = columns
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _moved(tensor: torch.Tensor, source: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """``tensor`` (rows x heads x width x dim) with column c of row i taken from column ``source[i, c]``, zero where
    ``empty``."""
    rows, heads, width, dim = tensor.shape
    index = source.to(tensor.device)[:, None, :, None].expand(rows, heads, width, dim)
    return tensor.gather(2, index).masked_fill(empty.to(tensor.device)[:, None, :, None], 0)


class BatchCache:
    """A transformers cache (``cache``) of several rows and their attention ``mask`` (rows x width, 1 where a row
    holds a token); every row's tokens end at the last column, so the next token of every row is one new column."""

    def __init__(self, cache: Any, mask: torch.Tensor) -> None:
        self.cache = cache
        self.mask = mask

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def positions(self) -> torch.Tensor:
        """The position of each row's next token: the tokens it holds (its padding is not counted)."""
        return self.mask.sum(dim=1, keepdim=True)

    def grow(self, columns: int = 1) -> torch.Tensor:
        """The mask of a forward that adds ``columns`` tokens to every row (columns of ones), kept as the new mask."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.rows, columns))], dim=1)
        return self.mask

    def settle(self, kept: list[int], added: int) -> None:
        """After a forward that added ``added`` columns to every row, row i keeps only the first ``kept[i]`` of them
        (its rejected drafts are dropped): each row's tokens move right to end at the last column again, the columns
        it frees on the left become padding, and columns no row holds a token in are cut."""
        shifts = torch.tensor([added - k for k in kept], dtype=torch.long)
        if not bool(shifts.any()):
            return
        source = torch.arange(self.width)[None, :] - shifts[:, None]  # rows x width: the column each comes from
        empty = source < 0
        source = source.clamp(min=0)
        self.mask = self.mask.gather(1, source.to(self.mask.device)).masked_fill(empty.to(self.mask.device), 0)
        for layer in _layers(self.cache):
            layer.keys = _moved(layer.keys, source, empty)
            layer.values = _moved(layer.values, source, empty)
        self.keep(list(range(self.rows)))

    def pad(self, columns: int) -> None:
        """Add ``columns`` empty columns on the left of every row."""
        if columns <= 0:
            return
        for layer in _layers(self.cache):
            layer.keys = _pad_left(layer.keys, columns, 2)
            layer.values = _pad_left(layer.values, columns, 2)
        self.mask = _pad_left(self.mask, columns, 1)

    def join(self, other: BatchCache) -> None:
        """Append ``other``'s rows after these, the narrower padded on the left to the wider's width."""
        width = max(self.width, other.width)
        self.pad(width - self.width)
        other.pad(width - other.width)
        for mine, theirs in zip(_layers(self.cache), _layers(other.cache)):
            mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
            mine.values = torch.cat([mine.values, theirs.values], dim=0)
        self.mask = torch.cat([self.mask, other.mask], dim=0)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order), then cut the leading columns none of them holds a token in."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, index)
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.width
        self.mask = self.mask[:, start:]
        for layer in _layers(self.cache):
            layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))[:, :, start:]
            layer.values = layer.values.index_select(0, index.to(layer.values.device))[:, :, start:]
