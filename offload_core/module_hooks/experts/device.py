"""Routed experts on an accelerator: copied to the device in few, large transfers, read ahead on a copy stream while
the previous layer computes, and kept in a device-resident expert cache, with one host wait per layer (the routing).

Every fused experts module computes on one full-shape buffer per shape on the device (:class:`Buffers`), in which
only the rows of the routed experts are filled, as :class:`ExpertLayer` does. Here the rows come from:

- the device cache (:class:`DeviceExperts`: one LFRU over every layer's experts, sized by the plan): a copy on
  the device, which takes microseconds where a copy from host memory takes a millisecond;
- a read-ahead slot, filled on the copy stream while the previous layer computed (the next layer's router on
  this layer's hidden state, or what it selected last); the compute stream waits for its event, the host never;
- host memory for the rest: straight from a page-locked store (its rows already are pinned memory: one copy per
  run of adjacent experts per tensor, no staging); from a store that packs them (a GGUF file's quantized blocks,
  :meth:`Store.packed_experts`) as the store holds them, dequantized on the device through scratch of its own (one
  for the compute stream, one for the copy stream); or, from any other store, gathered into pinned staging first
  (one copy per tensor and run).

The routing and the guess for the next layer reach the host in one transfer per layer: the only host wait.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from offload_core.module_hooks.experts.loader import ExpertLayer, read_expert, read_whole
from offload_core.module_hooks.experts.slots import DeviceExperts, DeviceRows, packed_experts, runs


#: the share of routed experts guesses must hit to be read ahead on an accelerator: a wrong guess costs a copy on the
#: copy stream while the previous layer computes (PCIe time that is otherwise idle), a right one a copy that no longer
#: delays this layer, so guesses pay at a far lower accuracy than on a CPU run (where a wrong one costs a read)
DEVICE_GUESS_PAYS = 0.3


class DeviceLayer(ExpertLayer):
    """A fused experts module on an accelerator (the module docstring says how its routed experts come in)."""

    def __init__(
        self,
        unit: Any,
        store: Mapping[str, torch.Tensor],
        shared: DeviceExperts,
        counters: Any,
        whole_fraction: float,
        reader: Any,
        index: int,
    ) -> None:
        super().__init__(unit, store, shared.buffers, shared.cache, counters, whole_fraction, reader)
        self.shared = shared
        self.accelerator = shared.accelerator
        self.index = index
        self.keys = list(self.specs)
        self.signature = tuple((shape[1:], dtype) for shape, dtype in self.specs.values())
        #: each tensor as the store packs it (a GGUF file's quantized blocks), decoded on the device; None: every
        #: tensor's routed rows cross as the store hands them out
        self.packed = packed_experts(store, self.keys)
        #: what a routed expert moves to the device: its packed bytes, or its rows as the store hands them out
        self.row_bytes = (
            sum(shape[1:].numel() * dtype.itemsize for shape, dtype in self.specs.values())
            if self.packed is None
            else sum(packed.expert_nbytes() for packed in self.packed.values())
        )
        #: a decoding pass's elements: one expert's rows of the largest tensor (the store's pass where smaller)
        self.decode_elements = max(shape[1:].numel() for shape, _ in self.specs.values())
        self.guess: dict[int, DeviceRows] = {}
        # a page-locked store: its rows are copied to the device as they lie
        self.direct = (
            self.packed is None
            and self.store.pinned
            and all(self.accelerator.is_pinned(store[key]) for key in self.keys)
        )

    # -- the routing ------------------------------------------------------------------------------
    def route(self, args: tuple, kwargs: dict) -> tuple[list[int], list[int]]:
        """This call's experts and the guess of the next layer's, brought to the host in one transfer."""
        index = kwargs["top_k_index"] if "top_k_index" in kwargs else args[self.position]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        flat = index.reshape(-1)
        guessed = None
        if self.next is not None and self.router is not None and hasattr(self.router, "indices"):
            guessed = self.router.indices(hidden)
        if guessed is not None and guessed.device == flat.device:
            values = torch.cat([flat, guessed.reshape(-1).to(flat.dtype)]).tolist()
            routed, ahead = values[: flat.numel()], sorted(set(values[flat.numel() :]))
        else:
            routed = flat.tolist()
            ahead = sorted(set(guessed.reshape(-1).tolist())) if guessed is not None else None
        experts = sorted({e for e in routed if 0 <= e < self.num_experts})
        if ahead is None:
            ahead = self.guess_next(hidden) if self.next is not None else []
        return experts, ahead

    # -- the compute thread -----------------------------------------------------------------------
    def load(self, args: tuple, kwargs: dict) -> None:
        experts, ahead = self.route(args, kwargs)
        self.score_guess(experts)
        self.cache.request([(self.index, e) for e in experts])
        tensors = {key: self.buffers.get(shape, dtype) for key, (shape, dtype) in self.specs.items()}
        stream = self.accelerator.current_stream(self.device)
        missing = [e for e in experts if self.cache.get((self.index, e)) is None and e not in self.guess]
        if missing and len(missing) >= self.whole_fraction * self.num_experts:
            self.drop_guesses([])
            self.read_whole(tensors)
            self.keep_routed(experts, tensors, stream)
        else:
            self.place_all(experts, missing, tensors, stream)
        self.drop_guesses([])
        self.unit.load(self.store, self.device, None, fetched=tensors)
        self.previous = experts
        if self.next is not None:
            self.next.read_ahead(ahead)

    @property
    def device(self) -> torch.device:
        return self.buffers.device

    def place_all(self, experts: list[int], missing: list[int], tensors: dict, stream: Any) -> None:
        """Fill the routed experts' rows of ``tensors``: device copies from the cache and the read-ahead slots, then
        the misses from host memory (few, large copies); the misses the cache wants are kept there."""
        buffers = [tensors[key] for key in self.keys]
        touched: list[DeviceRows] = []
        for expert in experts:
            rows = self.cache.get((self.index, expert))
            if rows is not None:
                self.counters.hits += 1
            elif expert in self.guess:
                rows = self.guess.pop(expert)
                self.counters.predicted_hits += 1
                self.ready(rows, stream)
                self.keep(expert, rows)
            else:
                continue
            for buffer, row in zip(buffers, rows.rows):
                buffer[expert].copy_(row)
            touched.append(rows)
        if missing:
            self.copy_missing(missing, buffers)
            self.counters.misses += len(missing)
        self.cache_rows(missing, buffers, stream, touched)

    def keep_routed(self, experts: list[int], tensors: dict, stream: Any) -> None:
        """After a whole read: the routed experts the cache wants are copied into it on the device."""
        new = [expert for expert in experts if self.cache.get((self.index, expert)) is None]
        self.cache_rows(new, [tensors[key] for key in self.keys], stream, [])

    def cache_rows(self, experts: list[int], buffers: list, stream: Any, touched: list[DeviceRows]) -> None:
        """Copy each of ``experts``' rows of ``buffers`` into the cache slot it is admitted to (if any), then mark
        those slots and ``touched`` used until this point of ``stream``."""
        for expert in experts:
            rows = self.admit(expert, stream)
            if rows is not None:
                for buffer, row in zip(buffers, rows.rows):
                    row.copy_(buffer[expert])
                touched.append(rows)
        if touched:
            used = self.accelerator.record_event(stream)
            for rows in touched:
                rows.used = used

    def ready(self, rows: DeviceRows, stream: Any) -> None:
        """The compute stream waits (on the device) for a read-ahead slot's copy; an unpinned store's read is
        waited for on the host where it has not finished."""
        if rows.future is not None:
            rows.written, rows.future = rows.future.result(), None
        self.accelerator.wait_event(stream, rows.written)

    def keep(self, expert: int, rows: DeviceRows) -> None:
        """A read-ahead slot that was used: kept in the cache where it ranks high enough (the slot it evicts becomes
        a read-ahead slot), else free for the next read-ahead."""
        key = (self.index, expert)
        if self.cache.wants(key):
            evicted = self.cache.spare()
            self.cache.admit(key, rows)
            if evicted is None or evicted.signature != self.signature:  # the cache grew, or freed another shape's
                evicted = self.shared.new_rows(self.signature)  # the read-ahead slots stay as many
            self.shared.give(self.signature, evicted)
            return
        self.shared.give(self.signature, rows)

    def admit(self, expert: int, stream: Any) -> DeviceRows | None:
        """The cache slot a miss is copied into on the device, where the cache keeps it (None: not kept)."""
        key = (self.index, expert)
        if not self.cache.wants(key):
            return None
        rows = self.cache.spare()
        if rows is None or rows.signature != self.signature:  # none to reuse, or one of another layer's shapes
            rows = self.shared.new_rows(self.signature)
        self.accelerator.wait_event(stream, rows.written)
        self.cache.admit(key, rows)
        return rows

    def copy_missing(self, missing: list[int], buffers: list[torch.Tensor]) -> None:
        """The misses' rows from host memory into the buffers on the compute stream (they are needed now): one
        copy per tensor and run of adjacent experts, from the page-locked store itself or from pinned staging
        gathered on this thread."""
        nbytes = self.row_bytes * len(missing)
        if self.packed is not None:
            self.decode(missing, buffers, "compute")
        elif self.direct:
            sources = [self.store[key] for key in self.keys]
            for first, end in runs(missing):
                for buffer, source in zip(buffers, sources):
                    buffer[first:end].copy_(source[first:end], non_blocking=True)
                    self.counters.transfers += 1
        else:
            staged = self.stage(missing)
            at = 0
            for first, end in runs(missing):
                for buffer, rows in zip(buffers, staged):
                    buffer[first:end].copy_(rows[at : at + end - first], non_blocking=True)
                    self.counters.transfers += 1
                at += end - first
        self.counters.add_bytes(len(self.keys) * len(missing), nbytes)

    def decode(self, experts: list[int], outs: list[torch.Tensor], stream: str, row: bool = False) -> None:
        """``experts``' packed bytes copied and decoded on the device into ``outs`` (one per tensor: the whole
        tensor's buffer, or with ``row`` the one expert's rows), through the scratch of ``stream``, on the current
        stream."""
        assert self.packed is not None
        for key, out in zip(self.keys, outs):
            packed = self.packed[key]
            scratch = self.scratch(stream, packed)
            for expert in experts:
                packed.decode_expert(expert, out if row else out[expert], scratch)
            self.counters.transfers += len(packed.parts) * len(experts)

    def scratch(self, stream: str, packed: Any) -> Any:
        """The shared decoding scratch of ``stream`` (``compute`` or ``ahead``), for passes of one expert's rows of
        this layer's largest tensor (the store's pass where smaller)."""
        return self.shared.scratch(stream, packed, min(self.decode_elements, packed.elements))

    def _host_row(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory of ``shape`` from the caching pinned allocator (copied from asynchronously)."""
        return self.accelerator.pinned_empty(shape.numel() * dtype.itemsize).view(dtype).view(shape)

    def stage(self, experts: list[int]) -> list[torch.Tensor]:
        """``experts``' rows gathered from the store into pinned host memory, one tensor per expert tensor (fresh
        from the caching pinned allocator, which reuses it only once the copies reading it are done)."""
        staged = []
        for key, (shape, dtype) in self.specs.items():
            with torch.inference_mode(False):
                rows = self._host_row(torch.Size([len(experts), *shape[1:]]), dtype)
            for at, expert in enumerate(experts):
                read_expert(self.store, key, expert, rows[at])
            staged.append(rows)
        return staged

    def read_whole(self, tensors: dict[str, torch.Tensor]) -> None:
        """Most experts routed (a prompt): each whole tensor in one copy from a page-locked store, else as
        :func:`read_whole` reads it."""
        for key, buffer in tensors.items():
            if self.packed is not None:
                packed = self.packed[key]
                packed.decode_on_device(buffer, self.scratch("compute", packed), key)
                self.counters.transfers += len(packed.parts)
            elif self.direct:
                buffer.copy_(self.store[key], non_blocking=True)
                self.counters.transfers += 1
            else:
                read_whole(self.store, key, buffer)
        self.counters.add_bytes(len(tensors), self.row_bytes * self.num_experts)
        self.counters.whole_reads += 1

    # -- reading ahead ----------------------------------------------------------------------------
    def read_ahead(self, experts: list[int]) -> None:
        """Copy the guessed ``experts`` (neither cached nor under way) into read-ahead slots on the copy stream, as
        many as there are free slots; from an unpinned store the reader thread stages them first."""
        if not self.counters.guessing:
            self.shadow = set(experts)
            with self.counters.lock:
                self.counters.guessed += len(experts)
            return
        with self.counters.lock:
            self.counters.guessed += len(experts)
        wanted = [e for e in experts if e not in self.guess and self.cache.get((self.index, e)) is None]
        taken = []
        for expert in wanted:
            rows = self.shared.take(self.signature)
            if rows is None:
                break
            taken.append((expert, rows))
        if not taken:
            return
        stream = self.shared.copy_stream()
        if not self.direct:
            for expert, rows in taken:
                rows.future = self.reader.submit(self.stage_ahead, expert, rows, stream)
                self.guess[expert] = rows
            return
        with self.accelerator.on_stream(stream):
            sources = [self.store[key] for key in self.keys]
            for expert, rows in taken:
                self.accelerator.wait_event(stream, rows.used)
                for row, source in zip(rows.rows, sources):
                    row.copy_(source[expert], non_blocking=True)
                    self.counters.transfers += 1
                self.guess[expert] = rows
            written = self.accelerator.record_event(stream)
        for _, rows in taken:
            rows.written = written
        self.counters.add_bytes(len(self.keys) * len(taken), self.row_bytes * len(taken))

    def stage_ahead(self, expert: int, rows: DeviceRows, stream: Any) -> Any:
        """On the reader thread: stage ``expert``'s rows from an unpinned store and copy them on the copy stream (or
        copy and decode its packed bytes there); the event after the copies."""
        staged = self.stage([expert]) if self.packed is None else []
        with self.accelerator.on_stream(stream):
            self.accelerator.wait_event(stream, rows.used)
            if self.packed is not None:
                self.decode([expert], rows.rows, "ahead", row=True)
            for row, source in zip(rows.rows, staged):
                row.copy_(source[0], non_blocking=True)
                self.counters.transfers += 1
            written = self.accelerator.record_event(stream)
        self.counters.add_bytes(len(self.keys), self.row_bytes)
        return written

    def drop_guesses(self, experts: list[int] | None = None) -> None:
        """Read-ahead slots the routing did not use go back (a read under way on the reader thread is cancelled, or
        waited for); their bytes are lost."""
        for expert in [e for e in self.guess if not experts or e not in experts]:
            rows = self.guess.pop(expert)
            if rows.future is not None:
                if not rows.future.cancel():
                    try:
                        rows.written = rows.future.result()
                    except Exception:  # a guess that failed costs nothing but its bytes: no one uses it
                        pass
                rows.future = None
            self.shared.give(self.signature, rows)
