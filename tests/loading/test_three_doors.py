"""One set of defaults behind the three doors: ``run.py``, ``offload_core.from_pretrained`` and
``load_checkpoint_and_dispatch`` with a placement name, given the same request and nothing else, make the same plan
field by field (device map, store, policy, page-cache rule, reservations, what is held for the KV cache, the
activations and a draft), and each door's own defaults are those of ``offload_core.defaults``."""

from __future__ import annotations

import inspect

import pytest
import transformers

import offload_core
from offload_core.options import Offload
from offload_core import defaults, init_empty_weights, load_checkpoint_and_dispatch
from offload_core.planning.generation import Generation
from offload_core.plan.prepare import prepare
from offload_core.runner.settings import build_strategies, read_settings

#: a tiny Llama, a GPT-2 (its own block class, tied head, 64 positions) and a tiny Mixtral (experts, whose parts
#: the safetensors store splices: units in flight held back), each with a cpu budget that holds the generation's memory
#: and the runtime's slack (a quarter of a small budget) beside part of the weights, the rest going to disk
BUDGETS = {"llama": 200 * 1024, "gpt2": 300 * 1024, "mixtral": 560 * 1024}
#: the page-cache plan's figure read from the memory available when it is made (it moves between two doors' calls)
MOVING = {"page_cache_budget"}


def _runner_door(compose_run, path, budget, extra, tmp_path):
    overrides = [
        "model=local",
        "model.tokenizer=bytes",
        f"model.path={path}",
        f"max_memory.cpu={budget}",
        "execution_device=cpu",
        "progress=false",
        *extra,
    ]
    settings = read_settings(compose_run(overrides), tmp_path / "run")
    strategies = build_strategies(settings)
    with prepare(settings, strategies, predict=False) as job:
        return job.plan, job.input_ids.shape[1]


def _python_doors(path, budget, generation, tmp_path, **options):
    made = offload_core.from_pretrained(
        path, {"cpu": budget}, {"execution_device": "cpu", **options}, generation=generation
    )
    config = transformers.AutoConfig.from_pretrained(path)
    with init_empty_weights():
        empty = transformers.AutoModelForCausalLM.from_config(config)
    dispatched = load_checkpoint_and_dispatch(
        empty,
        path,
        "sequential",
        max_memory={"cpu": budget},
        execution_device="cpu",
        progress=False,
        generation=generation,
        **options,
    )
    return made, dispatched


def _fields(plan) -> dict:
    """The plan as the doors must agree on it."""
    figures = plan.as_dict()
    figures["page_cache"] = {k: v for k, v in plan.page_cache.items() if k not in MOVING}
    return {
        "device_map": plan.device_map,
        "store": type(plan.storage).__name__,
        "policy": (type(plan.policy).__name__, vars(plan.policy.config)),
        "page_cache_rule": plan.page_cache.get("page_cache"),
        "reserve": plan.reserve,
        "headroom": plan.headroom,
        "held": plan.held,
        "summary": plan.summary,
        **figures,
    }


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_the_three_doors_make_the_same_plan_with_their_defaults(name, saved, compose_run, tmp_path):
    path, budget = saved(name).path, BUDGETS[name]
    planned, prompt_tokens = _runner_door(compose_run, path, budget, [], tmp_path)
    made, dispatched = _python_doors(path, budget, Generation(prompt_tokens=prompt_tokens), tmp_path)
    try:
        want = _fields(planned)
        assert "disk" in set(planned.device_map.values()) and "cpu" in set(planned.device_map.values())
        assert want["held"]["kv_cache"] > 0 and want["headroom"] > want["held"]["kv_cache"]
        assert want["store"] == "SafetensorsStorage" and want["page_cache_rule"] == "auto"
        for door in (made, dispatched):
            assert _fields(door.offload_plan) == want
    finally:
        made.offload_state.remove()
        dispatched.offload_state.remove()


def test_a_longer_generation_and_a_self_draft_are_held_alike_by_every_door(saved, compose_run, tmp_path):
    path = saved("llama").path
    budget = BUDGETS["llama"] + 32 * 1024
    extra = ["max_new_tokens=24", "speculative=self", "speculative.layers=1", "placement=balanced", "hook=prefetch"]
    planned, prompt_tokens = _runner_door(compose_run, path, budget, extra, tmp_path)
    generation = Generation(max_new_tokens=24, prompt_tokens=prompt_tokens)
    made = offload_core.from_pretrained(
        path,
        offload={
            "execution_device": "cpu",
            "placement": "balanced",
            "policy": "prefetch",
            "speculative": {"name": "self", "layers": 1},
        },
        max_memory={"cpu": budget},
        generation=generation,
    )
    try:
        assert planned.held["draft_kv_cache"] > 0
        assert _fields(made.offload_plan) == _fields(planned)
    finally:
        made.offload_state.remove()


def test_each_door_reads_its_defaults_from_one_module(compose_run):
    cfg = compose_run(["model=local", "model.path=unused"])
    assert (cfg.placement.name, cfg.storage.name, cfg.hook.name) == (
        defaults.PLACEMENT,
        defaults.STORAGE,
        defaults.POLICY,
    )
    assert (cfg.page_cache, cfg.headroom) == (defaults.PAGE_CACHE, defaults.HEADROOM)
    assert (cfg.max_new_tokens, cfg.batch_size) == (defaults.MAX_NEW_TOKENS, defaults.BATCH_SIZE)
    assert cfg.over_budget == defaults.OVER_BUDGET
    python = Offload()  # from_pretrained's options (its policy None: the default, prefetch for graphs or hybrid)
    assert (python.placement, python.storage, python.policy) == (defaults.PLACEMENT, defaults.STORAGE, None)
    assert (python.page_cache, python.headroom) == (defaults.PAGE_CACHE, defaults.HEADROOM)
    assert python.over_budget == defaults.OVER_BUDGET
    dispatch = inspect.signature(load_checkpoint_and_dispatch).parameters
    assert dispatch["storage"].default == defaults.STORAGE and dispatch["policy"].default == defaults.POLICY
    assert dispatch["page_cache"].default == defaults.PAGE_CACHE
    assert dispatch["headroom"].default == defaults.HEADROOM
    assert dispatch["over_budget"].default == defaults.OVER_BUDGET
    assert Generation() == Generation(defaults.MAX_NEW_TOKENS, defaults.BATCH_SIZE, defaults.PROMPT_TOKENS)


def test_auto_chooses_from_python_what_it_chooses_for_run_py(saved, compose_run, tmp_path, capsys, monkeypatch):
    from offload_core.plan.auto import choose

    # both doors read the same learned corrections: this test's own, not those other tests' runs of the same tiny
    # model update between the two choices
    monkeypatch.setenv("OFFLOAD_CORE_CORRECTIONS", str(tmp_path / "corrections.json"))
    path, budget = saved("llama").path, BUDGETS["llama"]
    overrides = ["model=local", "model.tokenizer=bytes", f"model.path={path}", f"max_memory.cpu={budget}"]
    overrides += ["execution_device=cpu", "progress=false", "auto=true", "storage=memmap"]
    settings = read_settings(compose_run(overrides), tmp_path / "run")
    chosen, table = choose(settings, overrides)
    with prepare(chosen, build_strategies(chosen), predict=False) as job:
        planned, prompt_tokens = job.plan, job.input_ids.shape[1]
    made = offload_core.from_pretrained(
        path,
        {"cpu": budget},
        {"execution_device": "cpu", "auto": True, "storage": "memmap", "offload_folder": tmp_path / "off"},
        generation=Generation(prompt_tokens=prompt_tokens),
    )
    try:
        ranked = made.offload_plan.auto
        assert len(ranked) > 1 and {row["configuration"] for row in ranked} == {row["configuration"] for row in table}
        assert all(row["configuration"].startswith("storage=memmap ") for row in ranked)  # given: kept
        assert ranked[0]["configuration"] == table[0]["configuration"]
        assert _fields(made.offload_plan) == _fields(planned)
    finally:
        made.offload_state.remove()


def test_auto_takes_plugin_names_only(saved):
    from offload_core.errors import ConfigError
    from offload_core.registry.manager import get_registry

    prefetch = get_registry().create("policy", "prefetch")
    with pytest.raises(ConfigError, match=r"^auto=True ranks plugins by name; policy=.* give its name, or drop auto$"):
        offload_core.from_pretrained(saved("llama").path, "1MiB", {"auto": True, "policy": prefetch})
