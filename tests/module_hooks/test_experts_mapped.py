"""Experts computed where their bytes lie: fused expert tensors spliced from the safetensors shards' pages once per
load, CPU experts layers on the store's mapped views, routed rows asked for before they are read, guesses that stop
when they do not pay; tokens always the in-memory model's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import offload_core
from offload_core.alignment import kernels_depend_on_alignment
from offload_core.module_hooks.experts import Experts, ExpertsConfig
from offload_core.module_hooks.experts.loader import (
    GUESS_PAYS,
    GUESS_WINDOW,
    ExpertCounters,
)
from offload_core.module_hooks.experts.mapped import MappedLayer
from offload_core.planning import compute_module_sizes
from offload_core.storage import pagecache
from tests.checkpoints import paged_mixtral
from tests.maps import file_backed


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def mixtral(request, tmp_path_factory):
    """A Mixtral whose per-expert tensors span whole pages (16 KiB and more), saved by transformers in ``dtype``."""
    config = paged_mixtral()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model = model.to(request.param)
    path = tmp_path_factory.mktemp("mixtral") / "ckpt"
    model.save_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=request.param).eval()
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    return path, ids, tokens, compute_module_sizes(reference)[""], reference, request.param


def test_fused_experts_are_spliced_from_the_shard_and_survive_a_drop(mixtral):
    path, _, _, _, reference, dtype = mixtral
    model = offload_core.from_pretrained(
        path, offload={"device_map": {"": "disk"}, "storage": "safetensors"}, dtype=dtype
    )
    store = model.offload_state.store
    fused = [name for name in store if name.endswith("gate_up_proj") or name.endswith("down_proj")]
    assert fused
    for name in fused:
        spliced = store.spliced(name)
        assert spliced is not None, name
        want = reference.get_parameter(name)
        assert torch.equal(spliced.tensor, want) and torch.equal(store[name], want)
        shard = str(spliced.pieces[0].part.path)
        assert file_backed(spliced.address, spliced.nbytes, shard) > spliced.nbytes // 2  # the shard's own pages
        assert store.drop(name)  # the mapped pages go; the copied edges are not zeroed
        assert torch.equal(spliced.tensor, want)
        assert store.spliced(name) is spliced  # once per load
    model.offload_state.remove()


@pytest.mark.parametrize("store", ["safetensors", "memmap"])
@pytest.mark.parametrize("guess", ["router", "none"])
def test_experts_on_mapped_views_give_the_in_memory_tokens(mixtral, store, guess, tmp_path):
    path, ids, want, total, _, dtype = mixtral
    model = offload_core.from_pretrained(
        path,
        offload={
            "storage": store,
            "policy": Experts(ExpertsConfig(guess=guess, cache_slots=0)),
            "offload_folder": tmp_path / "off",
            "over_budget": "warn",  # the tiny blocks are larger than a quarter of the model
        },
        max_memory={"cpu": total // 4},
        dtype=dtype,
    )
    layers = model.offload_state.handle.layers
    assert layers
    if store == "memmap" or not kernels_depend_on_alignment(dtype):  # else the spliced view is misplaced: rows copied
        assert all(isinstance(layer, MappedLayer) for layer in layers)
    with torch.no_grad():
        got = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    counters = model.offload_state.handle.counters()
    model.offload_state.remove()
    assert torch.equal(got, want)
    assert counters["expert_misses"] + counters["expert_guess_hits"] + counters["expert_whole_reads"] > 0


def test_routed_rows_are_asked_for_before_they_are_read(mixtral, tmp_path, monkeypatch):
    path, ids, want, total, _, dtype = mixtral
    """Every row read in (a cold page cache: nothing counts as resident) had its file range asked for first."""
    events: list[tuple] = []
    advise, map_in = pagecache.advise_ranges, pagecache.map_in

    def record_advise(ranges, advice):
        events.extend(("advise", str(p), s, e) for p, s, e in ranges)
        advise(ranges, advice)

    def record_map_in(tensor):
        events.append(("read", tensor.data_ptr(), tensor.numel() * tensor.element_size()))
        map_in(tensor)

    monkeypatch.setattr(pagecache, "advise_ranges", record_advise)
    monkeypatch.setattr(pagecache, "map_in", record_map_in)
    monkeypatch.setattr(pagecache, "resident", lambda tensor: False)
    model = offload_core.from_pretrained(
        path,
        offload={
            "device_map": {"": "disk"},
            "storage": "memmap",
            "policy": Experts(ExpertsConfig(guess="none", cache_slots=0)),
            "offload_folder": tmp_path / "off",
        },
        dtype=dtype,
    )
    layers = model.offload_state.handle.layers
    assert all(isinstance(layer, MappedLayer) for layer in layers)
    with torch.no_grad():
        got = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0
        )
    store = model.offload_state.store
    reads = [e for e in events if e[0] == "read"]
    assert torch.equal(got, want[:, : ids.shape[1] + 3]) and reads
    for layer in layers:
        for key, view in layer.views.items():
            row = view[0].numel() * view.element_size()
            for index, event in enumerate(events):
                if (
                    event[0] == "read"
                    and view.data_ptr() <= event[1] < view.data_ptr() + view.numel() * view.element_size()
                ):
                    start = event[1] - view.data_ptr()
                    ((file, begin, end),) = store.file_ranges(key, start, start + row)
                    assert any(
                        e[0] == "advise" and e[1] == str(file) and e[2] <= begin and end <= e[3] for e in events[:index]
                    ), (key, start)
    model.offload_state.remove()


def test_guessing_stops_while_it_does_not_pay_and_starts_again():
    counters = ExpertCounters()
    for _ in range(GUESS_WINDOW):
        counters.score(1, 2)  # half right
    assert not counters.guessing and counters.guess_pauses == 1
    for _ in range(GUESS_WINDOW):
        counters.score(2, 2)
    assert counters.guessing and counters.guess_pauses == 1
    assert counters.guessed_right == 3 * GUESS_WINDOW and GUESS_PAYS > 0.5


@pytest.mark.parametrize("converts", [False, True])
def test_experts_on_mapped_views_hold_nothing_back_from_the_cpu_budget(mixtral, converts):
    """A CPU run on a mapped store computes on views: nothing beyond prefetch's own reservation; a store that hands
    out copies (converts on read) still holds back the cache and the rows being read."""
    from offload_core import init_empty_weights
    from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
    from offload_core.planning.reservation import InFlight

    *_, reference, _ = mixtral
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(reference.config).eval()
    need = InFlight(
        execution_device=torch.device("cpu"),
        block_bytes=1 << 20,
        module_bytes=1 << 20,
        model=model,
        store_maps=True,
        store_converts=converts,
        cpu_budget=1 << 30,
    )
    policy = Experts(ExpertsConfig())
    held = policy.reserve(need)["cpu"] - Prefetch(PrefetchConfig()).reserve(need).get("cpu", 0)
    assert (held == 0) != converts
    assert ("computed on the store's views" in policy.plan_lines()[0]) != converts


def test_guesses_in_memory_already_wake_no_reader(mixtral, tmp_path):
    """Warm, a guess whose rows are in the page cache is served on the compute thread: the experts' reader never starts
    (a thread woken beside the compute's slows every parallel kernel on a small machine)."""
    path, ids, want, total, _, dtype = mixtral
    model = offload_core.from_pretrained(
        path,
        offload={
            "storage": "memmap",
            "policy": Experts(ExpertsConfig(guess="router", cache_slots=0)),
            "offload_folder": tmp_path / "off",
            "over_budget": "warn",  # the tiny blocks are larger than a quarter of the model
        },
        max_memory={"cpu": total // 4},
        dtype=dtype,
    )
    handle = model.offload_state.handle
    assert all(isinstance(layer, MappedLayer) for layer in handle.layers)
    for layer in handle.layers:  # in memory for sure: read in once
        layer.read_in(list(range(layer.num_experts)))
    with torch.no_grad():
        got = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    counters = handle.counters()
    running = handle.reader.running
    model.offload_state.remove()
    assert torch.equal(got, want)
    assert counters["expert_guess_hits"] > 0 and not running


def test_a_held_expert_whose_pages_were_taken_back_is_read_in_not_faulted_in(mixtral, tmp_path):
    """Cold (the pages dropped before every token, as the kernel may take back page cache): an expert the cache holds
    is read in with its file ranges asked for at once, counted as a miss, never computed on by page faults (each
    fault reads a read-ahead window around it, most of it experts no token chose)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    path, ids, want, total, _, dtype = mixtral
    model = offload_core.from_pretrained(
        path,
        offload={
            "device_map": {"": "disk"},
            "storage": "memmap",
            "policy": Experts(ExpertsConfig(guess="none", cache_slots=2)),
            "offload_folder": tmp_path / "off",
        },
        dtype=dtype,
    )
    handle, store = model.offload_state.handle, model.offload_state.store
    assert all(isinstance(layer, MappedLayer) for layer in handle.layers)
    keys = [key for layer in handle.layers for key in layer.views]
    store.wait_until_sealed()  # flushed: the kernel drops clean pages only

    class DropBeforeEachToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            assert all(store.drop(key) for key in keys)
            assert not any(pagecache.resident(view) for layer in handle.layers for view in layer.views.values())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with torch.no_grad():
        got = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([DropBeforeEachToken()]),
        )
    counters = handle.counters()
    model.offload_state.remove()
    assert torch.equal(got, want)
    assert counters["expert_misses"] > 0 and counters["expert_hits"] == 0
