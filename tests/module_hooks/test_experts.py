"""The expert-granular policy ``experts``: only routed experts are read, outputs bit-identical to the in-memory model,
the cache and the guesses counted; on CPU, with the stores that read in place, map or pin."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.errors import ConfigError
from offload_core.module_hooks.experts import ExpertCache, Experts, ExpertsConfig, is_fused_experts
from offload_core.planning import compute_module_sizes, device_of
from tests.checkpoints import Saved


def _dispatch(saved: Saved, path: Path, store: str, folder: Path, **config) -> torch.nn.Module:
    with init_empty_weights():
        model = saved.auto.from_config(saved.config).eval()
    total = compute_module_sizes(model)[""]
    load_checkpoint_and_dispatch(
        model,
        path,
        device_map="sequential",
        max_memory={"cpu": total // 8},
        over_budget="warn",  # the tiny blocks are larger than an eighth of the model
        storage=store,
        policy=Experts(ExpertsConfig(**config)),
        offload_folder=folder,
        execution_device="cpu",
        progress=False,
        headroom=0,
    )
    return model


def _routing(model: torch.nn.Module, inputs: dict) -> dict[int, set[int]]:
    """The experts each layer's fused experts module is routed to on ``inputs`` (the in-memory model)."""
    routed: dict[int, set[int]] = {}
    handles = []
    for name, module in model.named_modules():
        if is_fused_experts(module):
            layer = int(re.match(r".*?layers\.(\d+)\.", name).group(1))

            def record(mod, args, kwargs, layer=layer):
                routed.setdefault(layer, set()).update(torch.unique(args[1]).tolist())

            handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    with torch.no_grad():
        model(**inputs)
    for handle in handles:
        handle.remove()
    return routed


@pytest.mark.parametrize("name,store", [("mixtral", "safetensors"), ("qwen2_moe", "memmap"), ("mixtral", "pinned_cpu")])
def test_experts_policy_bit_identical(saved, name, store, tmp_path):
    moe = saved(name)
    model = _dispatch(moe, moe.path, store, tmp_path / "off")
    assert "disk" in set(model.hf_device_map.values())
    with torch.no_grad():
        got = model(**moe.inputs).logits
    counters = model.offload_state.handle.counters()
    model.offload_state.remove()
    assert torch.equal(got, moe.expected), (got - moe.expected).abs().max()
    assert counters["expert_misses"] + counters["expert_whole_reads"] > 0


@pytest.mark.parametrize(
    "store,cache_slots,guess",
    [("safetensors", 0, "none"), ("memmap", 0, "none"), ("safetensors", 2, "router"), ("memmap", 8, "previous")],
)
def test_never_routed_experts_are_never_read(saved, store, cache_slots, guess, tmp_path):
    """Per-expert tensors of the experts no token is routed to are NaN in the checkpoint: the logits are still
    the in-memory model's, and (with no cache or guess) exactly the routed experts' bytes were read. A
    wrong guess reads a NaN expert into its layer's rows: never used, and its rows are given back."""
    moe = saved("mixtral")
    reference = moe.auto.from_pretrained(moe.path).eval()
    inputs = {"input_ids": moe.inputs["input_ids"][:1, :1]}
    routed = _routing(reference, inputs)
    with torch.no_grad():
        want = reference(**inputs).logits
    poisoned = tmp_path / "ckpt"
    poisoned.mkdir()
    nan_rows = 0
    for file in moe.path.iterdir():
        if file.suffix != ".safetensors":
            (poisoned / file.name).write_bytes(file.read_bytes())
            continue
        state = load_file(file)
        for key in state:
            found = re.match(r".*?layers\.(\d+)\..*experts\.(\d+)\.", key)
            if found and int(found.group(2)) not in routed[int(found.group(1))]:
                state[key] = torch.full_like(state[key], float("nan"))
                nan_rows += 1
        save_file(state, poisoned / file.name, metadata={"format": "pt"})
    assert nan_rows > 0
    model = _dispatch(moe, poisoned, store, tmp_path / "off", cache_slots=cache_slots, guess=guess, whole_fraction=1.0)
    offloaded_layers = {k for k, v in model.hf_device_map.items() if v == "disk"}
    assert offloaded_layers
    with torch.no_grad():
        got = [model(**inputs).logits for _ in range(2)]  # the second call finds what the first cached or guessed
    counters = model.offload_state.handle.counters()
    model.offload_state.remove()
    assert all(torch.equal(g, want) and not torch.isnan(g).any() for g in got)
    if cache_slots or guess != "none":
        return
    experts = [m for m in model.modules() if is_fused_experts(m)]
    row = sum(p[0].numel() * p.element_size() for p in experts[0].parameters(recurse=False) if p.dim() == 3)
    assert counters["expert_bytes"] == counters["expert_misses"] * row > 0
    assert counters["expert_whole_reads"] == 0


def test_cache_and_guess_counters_over_decode(saved, tmp_path):
    moe = saved("mixtral")
    reference = moe.auto.from_pretrained(moe.path).eval()
    model = _dispatch(moe, moe.path, "safetensors", tmp_path / "off", cache_slots=4, guess="previous")
    ids = moe.inputs["input_ids"][:1, :1]
    with torch.no_grad():
        for _ in range(3):  # the same token again: the same routing, served from the cache
            assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    counters = model.offload_state.handle.counters()
    model.offload_state.remove()
    assert counters["expert_hits"] > 0 and counters["expert_hit_rate"] > 0.5
    assert counters["expert_bytes_per_token"] > 0
    assert counters["expert_cache_slots"] == 4


def test_router_guess_reads_ahead_and_scores(saved, tmp_path):
    moe = saved("mixtral")
    reference = moe.auto.from_pretrained(moe.path).eval()
    model = _dispatch(moe, moe.path, "memmap", tmp_path / "off", cache_slots=0, guess="router")
    ids = moe.inputs["input_ids"][:1, :1]
    with torch.no_grad():
        got = model(input_ids=ids).logits
    counters = model.offload_state.handle.counters()
    model.offload_state.remove()
    assert torch.equal(got, reference(input_ids=ids).logits)
    # One token routes 2 rows in each of 3 layers: each is a guessed hit or a miss. Layers 1 and 2 are guessed from
    # the layer before (4 rows); with guessing off there are no guessed hits and all 6 rows miss.
    assert counters["expert_guess_hits"] + counters["expert_misses"] == 6
    assert counters["expert_guess_hits"] >= 2
    assert counters["expert_guess_accuracy"] == counters["expert_guess_hits"] / 4


def test_cache_keeps_the_frequent_expert():
    cache = ExpertCache(1)
    for expert in (3, 3, 5):
        cache.request([expert])
        if cache.get(expert) is None:
            cache.admit(expert, {"w": expert})
    assert cache.get(3) == {"w": 3} and cache.get(5) is None


@pytest.mark.parametrize("bad", [{"cache_slots": -1}, {"guess": "oracle"}, {"whole_fraction": 0.0}])
def test_bad_settings_are_config_errors(bad):
    with pytest.raises(ConfigError):
        Experts(ExpertsConfig(**bad))


def test_a_full_cache_hands_back_the_evicted_rows_for_reuse():
    cache = ExpertCache(1)
    cache.request([1])
    cache.admit(1, {"w": "memory of 1"})
    cache.request([2])
    assert cache.wants(2)
    assert cache.spare() == {"w": "memory of 1"} and cache.get(1) is None
    assert cache.admit(2, {"w": "memory of 1"}) and cache.get(2) == {"w": "memory of 1"}


def test_cached_experts_are_used_in_place_with_no_read(saved, tmp_path):
    """A CPU run: every MoE layer runs on a tensor of its own, the same one on every call, so an expert the
    cache kept is neither read nor copied again."""
    moe = saved("mixtral")
    reference = moe.auto.from_pretrained(moe.path).eval()
    model = _dispatch(moe, moe.path, "safetensors", tmp_path / "off", cache_slots=8, guess="none")
    seen: dict[str, set[int]] = {}
    # The activation runs inside the experts' forward, while their weights are in place.
    handles = [
        module.act_fn.register_forward_pre_hook(
            lambda mod, args, name=name, experts=module: seen.setdefault(name, set()).add(
                experts.gate_up_proj.data_ptr()
            )
        )
        for name, module in model.named_modules()
        if is_fused_experts(module)
    ]
    ids = moe.inputs["input_ids"][:1, :1]
    read = []
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
            read.append(model.offload_state.handle.counters()["expert_bytes"])
    for handle in handles:
        handle.remove()
    model.offload_state.remove()
    assert len(seen) > 1 and all(len(pointers) == 1 for pointers in seen.values())
    assert len({next(iter(pointers)) for pointers in seen.values()}) == len(seen)  # one tensor per layer
    assert read[0] > 0 and read[0] == read[1] == read[2]


def test_released_rows_give_their_memory_back():
    from offload_core.module_hooks.experts import ReservedRows
    from offload_core.jobs.metrics import rss_split

    rows = ReservedRows(torch.Size([4, 1024, 1024]), torch.bfloat16)  # 2 MiB a row
    before = rss_split()[0]
    rows.tensor[2].fill_(1.0)
    written = rss_split()[0]
    rows.release(2)
    assert written - before >= 2 * 2**20 * 0.9
    assert rss_split()[0] < written - 2**20
    assert torch.count_nonzero(rows.tensor[2]) == 0  # read again, a released row is zeros (until written)


def test_the_store_is_told_which_experts_are_about_to_be_read(saved, tmp_path):
    """``Store.advise_expert`` comes before every read of an expert: a cold disk can start on all of them at once."""
    from offload_core.storage.inplace import InPlaceStore
    from offload_core_plugins.storage_safetensors import SafetensorsConfig, SafetensorsStorage

    events: list[tuple[str, str, int]] = []

    class Recording(InPlaceStore):
        def advise_expert(self, name, expert):
            events.append(("advise", name, expert))
            super().advise_expert(name, expert)

        def read_expert(self, name, expert, out):
            events.append(("read", name, expert))
            super().read_expert(name, expert, out)

    class RecordingStorage(SafetensorsStorage):
        def open(self, context):
            return Recording(context)

    moe = saved("mixtral")
    with init_empty_weights():
        model = moe.auto.from_config(moe.config).eval()
    load_checkpoint_and_dispatch(
        model,
        moe.path,
        device_map={"": "disk"},
        storage=RecordingStorage(SafetensorsConfig()),
        policy=Experts(ExpertsConfig(cache_slots=0, guess="router")),
        execution_device="cpu",
        progress=False,
    )
    with torch.no_grad():
        got = model(input_ids=moe.inputs["input_ids"][:1, :1]).logits
    model.offload_state.remove()
    reference = moe.auto.from_pretrained(moe.path).eval()
    assert torch.equal(got, reference(input_ids=moe.inputs["input_ids"][:1, :1]).logits)
    reads = [e for e in events if e[0] == "read"]
    assert reads
    for index, event in enumerate(events):
        if event[0] == "read":
            assert ("advise", *event[1:]) in events[:index], event


def test_the_cpu_budget_holds_back_the_expert_cache_and_the_rows_being_read(saved):
    from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
    from offload_core.planning.reservation import InFlight

    moe = saved("mixtral")
    with init_empty_weights():
        model = moe.auto.from_config(moe.config).eval()
    experts = [m for m in model.modules() if is_fused_experts(m)]
    row = sum(p[0].numel() * p.element_size() for p in experts[0].parameters(recurse=False) if p.dim() == 3)
    need = InFlight(execution_device=torch.device("cpu"), block_bytes=1 << 20, module_bytes=1 << 20, model=model)
    policy = Experts(ExpertsConfig(cache_slots=3))
    held = policy.reserve(need)["cpu"] - Prefetch(PrefetchConfig()).reserve(need).get("cpu", 0)
    # An expert's row: gate and up (2 x 64 x 32) and down (32 x 64), float32; 3 MoE layers of 4 experts, top 2.
    assert row == (2 * 64 * 32 + 32 * 64) * 4 == 24_576 and len(experts) == 3
    assert held == 368_640  # 3 slots x 3 layers, the 4 rows of a layer being read, 2 routed rows: 15 rows
    assert policy.plan_lines()[0].startswith(f"expert cache: 3 slots per layer x {len(experts)} MoE layers")


def test_on_a_model_without_experts_the_plan_says_it_reads_as_prefetch(saved):
    from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
    from offload_core.planning.reservation import InFlight

    dense = saved("llama")
    with init_empty_weights():
        model = dense.auto.from_config(dense.config).eval()
    need = InFlight(execution_device=torch.device("cpu"), block_bytes=1 << 20, module_bytes=1 << 20, model=model)
    policy = Experts(ExpertsConfig())
    assert policy.reserve(need) == dict(Prefetch(PrefetchConfig()).reserve(need))
    assert policy.plan_lines() == [
        "hook=experts: this model has no experts; its blocks are read as hook=prefetch reads them"
    ]


@pytest.mark.parametrize("spare_slots", [0, 1, 5])
def test_the_cache_takes_as_many_slots_as_the_cpu_budget_holds(saved, spare_slots):
    from offload_core.module_hooks.experts.policy import AUTO_SLOTS
    from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
    from offload_core.planning.reservation import InFlight

    moe = saved("mixtral")
    with init_empty_weights():
        model = moe.auto.from_config(moe.config).eval()
    experts = [m for m in model.modules() if is_fused_experts(m)]
    row = sum(p[0].numel() * p.element_size() for p in experts[0].parameters(recurse=False) if p.dim() == 3)
    reading = (experts[0].num_experts + moe.config.num_experts_per_tok) * row
    budget = reading + spare_slots * len(experts) * row + row // 2  # room for spare_slots slots, not one more
    need = InFlight(
        execution_device=torch.device("cpu"), block_bytes=1 << 20, module_bytes=1 << 20, model=model, cpu_budget=budget
    )
    policy = Experts(ExpertsConfig())
    held = policy.reserve(need)["cpu"] - Prefetch(PrefetchConfig()).reserve(need).get("cpu", 0)
    slots = min(spare_slots, AUTO_SLOTS)
    assert held == reading + slots * len(experts) * row <= budget
    assert f"expert cache: {slots} slots per layer (as many as the cpu budget holds)" in policy.plan_lines()[0]
    assert (
        Experts(ExpertsConfig(cache_slots=4)).reserve(need)["cpu"] >= 4 * len(experts) * row
    )  # a number given is kept


def test_without_a_cache_a_cpu_run_reads_each_routed_expert_once_into_its_row(saved, tmp_path):
    """No cache, no guess, one token (too few experts for a whole read): every expert a layer is routed to is read from
    the store straight into its row of the buffer; nothing is a hit. The routing is the in-memory model's."""
    moe = saved("mixtral")
    reference = moe.auto.from_pretrained(moe.path).eval()
    inputs = {"input_ids": moe.inputs["input_ids"][:1, :1]}
    routed = _routing(reference, inputs)
    with torch.no_grad():
        want = reference(**inputs).logits
    model = _dispatch(moe, moe.path, "safetensors", tmp_path / "off", cache_slots=0, guess="none", whole_fraction=1.0)
    with torch.no_grad():
        got = model(**inputs).logits
    counters = model.offload_state.handle.counters()
    device_map = dict(model.hf_device_map)
    model.offload_state.remove()
    assert torch.equal(got, want)
    assert counters["expert_hits"] == 0 and counters["expert_whole_reads"] == 0

    assert {device_of(device_map, f"model.layers.{i}.mlp.experts") for i in routed} == {
        "disk"
    }  # every layer's experts come from the store
    assert counters["expert_misses"] == sum(len(experts) for experts in routed.values()) == 2 * len(routed) > 0  # top 2
