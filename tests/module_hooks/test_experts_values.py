"""The experts loader's values worked by hand on the small module of ``experts_layer.py`` (4 experts, 28 bytes each),
on the CPU: which rows are read into which buffer rows, what is counted (hits, misses, guesses, bytes, tensors), when
a call reads whole tensors, and how the read-ahead guess is chosen, scored and dropped."""

from __future__ import annotations

import torch

from offload_core.module_hooks.experts.loader import (
    GUESS_JUDGED,
    Buffers,
    ExpertCounters,
    ExpertsHook,
    is_fused_experts,
    read_expert,
    read_whole,
    routing_argument,
)
from offload_core.module_hooks.units import TransferStats
from tests.module_hooks.experts_layer import (
    EXPERTS,
    ROW_BYTES,
    Moe,
    RecordingStore,
    fill,
    make_layer,
    routing,
    store_tensors,
)


def test_a_guess_is_judged_over_the_last_calls_once_there_are_eight():
    counters = ExpertCounters()
    for _ in range(GUESS_JUDGED - 1):  # 7 calls that guessed nothing right: too few to judge
        counters.score(0, 2)
    assert counters.guessing and counters.guess_pauses == 0
    assert (counters.guessed_right, counters.routed, len(counters.window)) == (0, 14, 7)
    counters.score(0, 2)  # the 8th: 0 of 16 routed experts guessed, under 80%
    assert not counters.guessing and counters.guess_pauses == 1
    counters.score(0, 2)  # still under: no second pause
    assert not counters.guessing and counters.guess_pauses == 1


def test_a_guess_pays_at_exactly_four_fifths_of_the_routed_experts_and_guessing_starts_again():
    counters = ExpertCounters(guessing=False)
    for _ in range(8):  # 8 calls of 4 right of 5: 32 >= 0.8 x 40
        counters.score(4, 5)
    assert counters.guessing and counters.guess_pauses == 0
    assert (counters.guessed_right, counters.routed) == (32, 40)
    counters.score(3, 5)  # 35 of 45 (the window holds all 9): 35 < 36
    assert not counters.guessing and counters.guess_pauses == 1
    counters.score(5, 5)  # 40 of 50 = 0.8: pays again
    assert counters.guessing and counters.guess_pauses == 1
    counters.score(0, 5)  # 40 of 55: the second pause
    assert not counters.guessing and counters.guess_pauses == 2


def test_the_window_holds_the_last_32_calls():
    counters = ExpertCounters()
    for _ in range(32):
        counters.score(0, 1)
    for _ in range(32):  # the 32 bad calls leave the window one by one: it pays once 26 of 32 are good (>= 25.6)
        counters.score(1, 1)
    assert counters.guessing and len(counters.window) == 32 and sum(r for r, _ in counters.window) == 32


def test_bytes_are_counted_in_the_counters_and_the_runs_transfer_stats():
    stats = TransferStats()
    counters = ExpertCounters(stats=stats)
    counters.add_bytes(2, 56)
    counters.add_bytes(3, 10)
    assert counters.bytes == 66 and stats.snapshot() == {"loads": 5, "bytes": 66}
    alone = ExpertCounters()
    alone.add_bytes(1, 7)
    assert alone.bytes == 7


def test_one_buffer_per_shape_and_dtype_outside_inference_mode():
    buffers = Buffers(torch.device("cpu"))
    with torch.inference_mode():
        first = buffers.get(torch.Size([4, 2, 3]), torch.float32)
    assert first.shape == (4, 2, 3) and first.dtype == torch.float32 and not first.is_inference()
    assert buffers.get(torch.Size([4, 2, 3]), torch.float32) is first
    half = buffers.get(torch.Size([4, 2, 3]), torch.float16)
    assert half is not first and half.dtype == torch.float16 and len(buffers.buffers) == 2


def test_the_layer_knows_its_routing_argument_and_one_experts_bytes():
    layer = make_layer()
    assert layer.position == 1 and layer.num_experts == EXPERTS
    assert layer.row_bytes == ROW_BYTES == 28
    assert layer.specs == {"gu": ((4, 2, 3), torch.float32), "dn": ((4, 1, 2), torch.float16)}
    assert layer.next is None and layer.guess == {} and layer.shadow == set() and layer.previous == []


def test_selected_experts_are_unique_sorted_and_in_range():
    layer = make_layer()
    index = torch.tensor([[3, -1], [4, 0], [3, 0]])  # -1 and 4: padding and out of range, dropped
    assert layer.selected((None, index, None), {}) == [0, 3]
    assert layer.selected((None,), {"top_k_index": torch.tensor([[2, 1]])}) == [1, 2]
    assert layer.selected((None, torch.tensor([[0, 3]])), {"top_k_index": torch.tensor([[1, 1]])}) == [1]


def test_without_a_cache_routed_experts_are_read_into_their_rows_and_nothing_else():
    store = store_tensors()
    layer = make_layer(store)
    buffers = fill(layer, -1.0)
    layer.load(*routing(3, 1))
    assert torch.equal(buffers["gu"][1], store["gu"][1]) and torch.equal(buffers["gu"][3], store["gu"][3])
    assert torch.equal(buffers["dn"][1], store["dn"][1]) and torch.equal(buffers["dn"][3], store["dn"][3])
    assert (buffers["gu"][0] == -1).all() and (buffers["dn"][2] == -1).all()  # not routed: not read
    assert layer.unit.module.gate_up_proj.data_ptr() == buffers["gu"].data_ptr() and layer.unit.loaded
    c = layer.counters
    assert (c.misses, c.hits, c.predicted_hits, c.whole_reads) == (2, 0, 0, 0)
    assert c.bytes == 2 * ROW_BYTES and c.stats.snapshot() == {"loads": 4, "bytes": 56}  # 2 tensors x 2 experts
    assert layer.previous == [1, 3] and layer.cache.resident == {}
    layer.release()
    assert not layer.unit.loaded and layer.unit.module.gate_up_proj.device.type == "meta"


def test_a_cached_expert_is_a_hit_and_a_full_cache_reads_the_next_into_the_evicted_rows():
    store = store_tensors()
    layer = make_layer(store, slots=1)
    buffers = fill(layer, -1.0)
    layer.load(*routing(2))  # a miss, kept
    kept = layer.cache.get(2)
    assert kept is not None and torch.equal(kept["gu"], store["gu"][2]) and torch.equal(kept["dn"], store["dn"][2])
    assert not kept["gu"].is_inference() and kept["dn"].dtype == torch.float16 and kept["dn"].shape == (1, 2)
    assert (layer.counters.misses, layer.counters.hits) == (1, 0)
    layer.release()
    pointers = {key: row.data_ptr() for key, row in kept.items()}
    # 0 asked for as often as 2 (once) and later: it takes the slot, read into 2's rows (no new memory)
    layer.load(*routing(0, kwargs=True))
    assert layer.cache.get(2) is None and set(layer.cache.resident) == {0}
    rows = layer.cache.get(0)
    assert {key: row.data_ptr() for key, row in rows.items()} == pointers
    assert torch.equal(rows["gu"], store["gu"][0]) and torch.equal(buffers["gu"][0], store["gu"][0])
    assert torch.equal(rows["dn"], store["dn"][0]) and torch.equal(buffers["dn"][0], store["dn"][0])
    assert (layer.counters.misses, layer.counters.hits, layer.counters.bytes) == (2, 0, 2 * ROW_BYTES)
    layer.release()
    fill(layer, -1.0)
    layer.load(*routing(0))  # from the cache: copied into its row, no bytes read
    assert (layer.counters.misses, layer.counters.hits, layer.counters.bytes) == (2, 1, 2 * ROW_BYTES)
    assert torch.equal(buffers["gu"][0], store["gu"][0]) and torch.equal(buffers["dn"][0], store["dn"][0])
    assert layer.counters.stats.snapshot() == {"loads": 4, "bytes": 56}


def test_half_the_experts_missing_reads_whole_tensors_but_cached_and_guessed_ones_do_not_count():
    store = RecordingStore()
    layer = make_layer(store, slots=2, whole_fraction=0.5)
    layer.load(*routing(0))  # 1 of 4 missing, under half: a row read, kept
    assert store.calls == [("read_expert", "gu", 0), ("read_expert", "dn", 0)] and layer.counters.whole_reads == 0
    layer.release()
    store.calls.clear()
    layer.load(*routing(0, 1))  # 0 is cached: 1 missing, still under half
    assert store.calls == [("read_expert", "gu", 1), ("read_expert", "dn", 1)] and layer.counters.whole_reads == 0
    assert (layer.counters.hits, layer.counters.misses) == (1, 2)
    layer.release()
    layer.read_ahead([2])
    layer.reader.run()
    store.calls.clear()
    layer.load(*routing(1, 2, 3))  # 1 cached, 2 guessed: 1 missing (3)
    assert store.calls == [("read_expert", "gu", 3), ("read_expert", "dn", 3)] and layer.counters.whole_reads == 0
    assert (layer.counters.hits, layer.counters.predicted_hits, layer.counters.misses) == (2, 1, 3)
    layer.release()
    store = RecordingStore()
    layer = make_layer(store, slots=2, whole_fraction=0.5)
    buffers = fill(layer, -1.0)
    layer.load(*routing(0, 3))  # 2 of 4 missing, half: whole tensors, one read each
    assert store.calls == [("read_into", "gu"), ("read_into", "dn")]
    assert layer.counters.whole_reads == 1 and layer.counters.misses == 0 and layer.cache.resident == {}
    assert layer.counters.bytes == 4 * ROW_BYTES and layer.counters.stats.snapshot() == {"loads": 2, "bytes": 112}
    assert torch.equal(buffers["gu"], store["gu"]) and torch.equal(buffers["dn"], store["dn"])


def test_whole_reads_from_a_store_without_read_into_copy_its_tensors():
    store = store_tensors()
    layer = make_layer(store, whole_fraction=0.25)
    buffers = fill(layer, -1.0)
    layer.load(*routing(2))
    assert layer.counters.whole_reads == 1 and layer.counters.misses == 0
    assert torch.equal(buffers["gu"], store["gu"]) and torch.equal(buffers["dn"], store["dn"])
    assert layer.counters.bytes == 4 * ROW_BYTES and layer.counters.stats.snapshot() == {"loads": 2, "bytes": 112}
    layer.release()
    layer.load(*routing(1))  # a second call: a second whole read (no cache)
    assert layer.counters.whole_reads == 2 and layer.counters.bytes == 8 * ROW_BYTES


def test_read_expert_and_read_whole_use_the_stores_own_readers_where_it_has_them():
    store = RecordingStore()
    out = torch.zeros(2, 3)
    read_expert(store, "gu", 3, out)
    assert store.calls == [("read_expert", "gu", 3)] and torch.equal(out, store["gu"][3])
    plain = store_tensors()
    half = torch.zeros(1, 2, dtype=torch.float16)
    read_expert(plain, "dn", 1, half)
    assert half.tolist() == [[102.0, 103.0]]
    whole = torch.zeros(4, 2, 3)
    read_whole(store, "gu", whole)
    assert store.calls[-1] == ("read_into", "gu") and torch.equal(whole, store["gu"])


def test_guessing_off_keeps_the_guess_as_a_shadow_to_score():
    layer = make_layer()
    layer.counters.guessing = False
    layer.read_ahead([1, 2])
    assert layer.shadow == {1, 2} and layer.guess == {} and layer.reader.work == []
    assert layer.counters.guessed == 2
    layer.read_ahead([1, 0, 3])
    assert layer.shadow == {0, 1, 3} and layer.counters.guessed == 5
    layer.read_ahead([1, 2])
    layer.load(*routing(2, 3))  # 1 of the 2 routed experts was guessed
    assert (layer.counters.guessed_right, layer.counters.routed) == (1, 2) and layer.shadow == set()
    assert layer.counters.predicted_hits == 0 and layer.counters.misses == 2


def test_read_ahead_reads_only_experts_neither_cached_nor_under_way():
    store = RecordingStore()
    layer = make_layer(store, slots=1)
    layer.load(*routing(0))
    layer.release()
    layer.read_ahead([1])
    store.calls.clear()
    layer.read_ahead([0, 1, 2])  # 0 cached, 1 under way: only 2
    assert sorted(layer.guess) == [1, 2] and len(layer.reader.work) == 2
    assert layer.counters.guessed == 4
    layer.reader.run()
    assert store.calls == [("read_expert", "gu", 1), ("read_expert", "dn", 1)] + [
        ("read_expert", "gu", 2),
        ("read_expert", "dn", 2),
    ]
    assert layer.counters.bytes == 3 * ROW_BYTES
    layer.load(*routing(1))  # read ahead: a predicted hit, and kept (as often asked for as 0, and later)
    assert (layer.counters.predicted_hits, layer.counters.misses, layer.counters.hits) == (1, 1, 0)
    assert set(layer.cache.resident) == {1} and torch.equal(layer.cache.get(1)["dn"], store["dn"][1])
    assert layer.guess == {} and layer.counters.bytes == 3 * ROW_BYTES


def test_a_guess_the_routing_took_is_a_predicted_hit_and_the_others_are_cancelled():
    store = store_tensors()
    first, second = make_layer(store), make_layer(store)
    first.next = second
    second.load(*routing(1, 2))  # what the second layer selected last: the guess without a router
    second.release()
    assert second.counters.misses == 2
    first.load(*routing(0))
    assert sorted(second.guess) == [1, 2] and second.counters.guessed == 2
    second.reader.work[1][0].cancel()  # the read of 2 not started yet
    second.reader.run()
    buffers = fill(second, -1.0)
    second.load(*routing(1, 3))
    assert (second.counters.guessed_right, second.counters.routed) == (1, 2)
    assert (second.counters.predicted_hits, second.counters.misses) == (1, 3)
    assert second.guess == {}
    assert torch.equal(buffers["gu"][1], store["gu"][1]) and torch.equal(buffers["dn"][3], store["dn"][3])
    assert second.counters.bytes == 4 * ROW_BYTES  # 1 and 2, then the guess of 1 and the miss of 3
    second.release()
    first.release()
    first.load(*routing(2))  # guesses 1 and 3 for the second layer: both taken
    second.reader.run()
    second.load(*routing(3, 1))
    assert (second.counters.predicted_hits, second.counters.misses) == (3, 3)
    assert (second.counters.guessed_right, second.counters.routed, second.counters.guessed) == (3, 4, 4)


def test_drop_guesses_cancels_what_the_routing_did_not_select():
    layer = make_layer()
    layer.read_ahead([0, 1, 2])
    futures = dict(layer.guess)
    layer.drop_guesses([1])
    assert list(layer.guess) == [1] and futures[0].cancelled() and futures[2].cancelled()
    assert not futures[1].cancelled()
    layer.drop_guesses()
    assert layer.guess == {} and futures[1].cancelled()


def test_the_next_layers_guess_comes_from_its_router_on_this_hidden_state_else_its_last_routing():
    seen = []

    def router(hidden):
        seen.append(hidden)
        return None if len(seen) <= 2 else [3]

    first, second = make_layer(router=router), make_layer()
    assert first.guess_next(torch.zeros(1, 3)) == []  # no guess from the router, and no next layer
    first.next = second
    second.previous = [0, 2]
    args, kwargs = routing(1, kwargs=True)
    first.load(args, kwargs)  # the router has no guess: the second layer's last routing
    first.release()
    assert seen[1] is kwargs["hidden_states"] and sorted(second.guess) == [0, 2]
    second.drop_guesses()
    args, _ = routing(1)
    first.load(args, {})
    assert seen[2] is args[0] and list(second.guess) == [3]
    second.drop_guesses()


def test_the_hook_loads_before_forward_and_puts_the_placeholders_back_after():
    layer = make_layer()
    hook = ExpertsHook(layer)
    module = layer.unit.module
    args, kwargs = routing(2)
    assert hook.pre_forward(module, args, kwargs) == (args, kwargs)
    assert layer.unit.loaded and module.down_proj.device.type == "cpu"
    output = object()
    assert hook.post_forward(module, output) is output
    assert not layer.unit.loaded and module.down_proj.device.type == "meta"
    for done in (hook.on_error, hook.detach_hook):
        hook.pre_forward(module, args, kwargs)
        done(module)
        assert not layer.unit.loaded


def test_a_forward_without_a_signature_takes_no_routing():
    for forward in (torch.relu, 3):  # no signature found (ValueError), not callable (TypeError)
        module = Moe()
        module.forward = forward
        assert routing_argument(module) is None and not is_fused_experts(module)
    assert routing_argument(Moe()) == 1 and is_fused_experts(Moe())
