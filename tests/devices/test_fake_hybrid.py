"""``hybrid=true`` on the fake accelerator: the split solved from given rates, host units computed on the host from the
store's tensors (their KV cache on the host) while the others stream, prefill and batches never on the host, and the
tokens and logits of the CPU in-memory model (the fake GPU computes on the CPU, so nothing differs by rounding)."""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import dispatch_model
from offload_core.module_hooks.prefetch import PrefetchConfig
from offload_core.module_hooks.prefetch.hybrid import HybridPrefetch, host_threads
from offload_core.planning.hybrid import Rates, solve_split, spread

from tests import ROOT

MB = 10**6


def test_the_split_balances_host_compute_against_the_copies():
    """Ten 100 MB blocks, copies at 50 GB/s (2 ms a block), the host at 25 GB/s (4 ms), a free GPU: by hand, k blocks
    on the host bound a step at max((10 - k) x 2, 4k) ms: k=3 gives 14 ms against 20 ms copying all."""
    split = solve_split([100 * MB] * 10, list(range(10)), Rates(h2d_bps=50e9, host_bps=25e9))
    assert split.host == [1, 5, 8]  # spread along the order, streamed blocks between them
    assert split.streamed == [0, 2, 3, 4, 6, 7, 9]
    assert math.isclose(split.copy_s, 0.014) and math.isclose(split.host_s, 0.012)
    assert math.isclose(split.step_s, 0.014) and math.isclose(split.copy_only_s, 0.020)
    assert math.isclose(split.ratio, 0.7)


def test_the_gpus_compute_counts_on_the_host_side():
    """The same blocks with the GPU computing at 100 GB/s (1 ms a block) and 2 ms for its resident part: the host's
    side is host + GPU = 12 + 3k ms, the copies (10 - k) x 2: k=1 gives 18 ms, k=2 is no better (18, 16)."""
    split = solve_split([100 * MB] * 10, list(range(10)), Rates(50e9, 25e9, gpu_bps=100e9, resident_s=0.002))
    assert len(split.host) == 1
    assert math.isclose(split.step_s, 0.018) and math.isclose(split.gpu_s, 0.011)


def test_no_block_goes_to_the_host_when_the_host_is_slower_than_all_copies():
    """A host 10x slower than the copies: one block there (20 ms) is already above streaming all (20 ms)."""
    split = solve_split([100 * MB] * 10, list(range(10)), Rates(50e9, 5e9))
    assert split.host == [] and split.step_s == split.copy_only_s
    assert solve_split([100 * MB] * 4, [1, 2], Rates(50e9, 1e12)).host == [1, 2]  # only eligible ones
    assert spread(2, [0, 1, 2, 3]) == [1, 3]


def _llama(layers=4, seed=0):
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


MAP = {
    "model.embed_tokens": 0,
    "model.layers.0": 0,
    "model.layers.1": "cpu",
    "model.layers.2": "cpu",
    "model.layers.3": "cpu",
    "model.norm": 0,
    "model.rotary_emb": 0,
    "lm_head": 0,
}


def _hybrid(model, tmp_path, host=("model.layers.2",)):
    dispatch_model(
        model, MAP, storage="pinned_cpu", policy=HybridPrefetch(PrefetchConfig(), list(host)), offload_folder=tmp_path
    )
    return model.offload_state.handle


@pytest.fixture
def eight_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    yield
    torch.set_num_threads(before)


def test_decoding_computes_host_units_on_the_host_and_gives_the_in_memory_tokens(
    tmp_path, fake_gpu, monkeypatch, eight_threads
):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))  # four cores: three compute
    fake = fake_gpu(count=1, memory="64MiB")
    ids = torch.randint(0, 320, (1, 5), generator=torch.Generator().manual_seed(1))
    model = _llama()
    threads = torch.get_num_threads()
    handle = _hybrid(model, tmp_path)
    assert torch.get_num_threads() == host_threads() == 3  # the cores less the one that issues the copies
    reference = _llama()  # computed with the same threads (their count changes a CPU matmul's sums)
    with torch.no_grad():
        expected = reference.generate(
            ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    seen = []  # where layer 2 computed, and where its KV cache was, each call
    layer = model.model.layers[2]
    attention = layer.self_attn.forward

    def watched(*args, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        keys = cache.layers[2].keys
        seen.append((layer.mlp.up_proj.weight.device.type, keys.device.type if keys is not None else None))
        return attention(*args, **kwargs)

    layer.self_attn.forward = watched
    with torch.no_grad():
        out = model.generate(
            ids.to(fake.device(0)), max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    assert torch.equal(out.sequences.cpu(), expected.sequences)
    for got, want in zip(out.logits, expected.logits):
        assert got.device == fake.device(0) and torch.equal(got.cpu(), want)
    # the prefill streamed layer 2 to the GPU (its cache was made there); every decoding step computed it on the
    # host from the pinned store's own tensor, with its cache moved to the host
    assert seen[0] == ("fakegpu", None) and seen[1:] == [("cpu", "cpu")] * 7
    store = model.offload_state.store
    counters = handle.counters()
    assert counters["host_units"] == 1 and counters["host_calls"] == 7 and counters["invalidations"] == 0
    # the other offloaded layers streamed every step; layer 2 only in the prefill
    per_layer = sum(t.numel() * t.element_size() for t in _llama().model.layers[1].parameters())
    assert model.offload_state.stats.bytes == per_layer * (2 * 8 + 1)
    assert store.pinned
    model.offload_state.remove()
    assert torch.get_num_threads() == threads == 8
    del out, got  # the logits and KV cache
    assert fake.memory_allocated(0) == 0


def test_prefill_and_batches_stream_every_unit(tmp_path, fake_gpu):
    """A step of more than one token (two sequences decoding together) never computes on the host."""
    fake = fake_gpu(count=1, memory="64MiB")
    ids = torch.randint(0, 320, (2, 5), generator=torch.Generator().manual_seed(2))
    reference = _llama()
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=4, do_sample=False)
    model = _llama()
    handle = _hybrid(model, tmp_path, host=("model.layers.1", "model.layers.3"))
    with torch.no_grad():
        out = model.generate(ids.to(fake.device(0)), max_new_tokens=4, do_sample=False)
    assert torch.equal(out.cpu(), expected)
    assert handle.counters()["host_calls"] == 0 and handle.counters()["host_units"] == 2
    model.offload_state.remove()


@pytest.mark.slow  # three whole runs on the fake GPU (the quick subset stays under a minute)
@pytest.mark.parametrize("hybrid", ["given", "measured", "off"])
def test_a_hybrid_run_on_a_gpu_plans_the_split_and_matches_in_memory(hybrid, tmp_path, fake_gpu, capsys, monkeypatch):
    """The whole run: the plan prints the split, decoding steps compute its host blocks on the host, the tokens are the
    in-memory model's. ``given``: a host as fast as memory and slow copies put all four blocks there."""
    from offload_core.runner.config import register_configs
    from offload_core.runner.job import run
    from offload_core.plan import hybrid as planning

    from offload_core.module_hooks.prefetch.prefetcher import Prefetcher

    if hybrid == "given":
        monkeypatch.setattr(planning, "measured_rates", lambda *args: Rates(h2d_bps=1e9, host_bps=1e12))
    copies: dict[str, int] = {}  # unit name -> copies to the GPU while decoding
    copy_in = Prefetcher._copy_in

    def counted(self, unit, *args, **kwargs):
        if getattr(self, "decoding", False):
            copies[unit.name] = copies.get(unit.name, 0) + 1
        return copy_in(self, unit, *args, **kwargs)

    monkeypatch.setattr(Prefetcher, "_copy_in", counted)
    fake_gpu(count=1, memory=8 * 2**20)
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[
                "model=synthetic",
                "hook=prefetch",
                "storage=pinned_cpu",
                "max_new_tokens=4",
                "progress=false",
                "compare_in_memory=true",
                "+max_memory.0=2MiB",
                "max_memory.cpu=200MiB",
                "headroom=256KiB",
                f"hybrid={str(hybrid != 'off').lower()}",
            ],
        )
    result = run(cfg, output_dir=tmp_path)
    out = capsys.readouterr().out
    assert result.matches_in_memory is True
    counters = result.figures["prefetch"]
    if hybrid == "off":
        assert "hybrid:" not in out and "host_calls" not in counters
        return
    assert "hybrid:" in out and "copy-only bound" in out, out
    host = int(out.split("hybrid: ")[1].split(" of ")[0])
    assert counters["host_units"] == host and (host == 4 or hybrid == "measured")
    assert counters["host_calls"] == host * 3  # every decoding step after the prefill
    if hybrid == "given":  # no host block is copied in the decoding steps (but once, read ahead before the first
        # decoding step showed itself), though the run keeps a page-cache set; the other offloaded units are
        assert all(copies.get(f"model.layers.{i}", 0) <= 1 for i in range(4)) and sum(copies.values()) >= 3, copies


def _compose(*overrides):
    from offload_core.runner.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(
            config_name="config",
            overrides=["model=synthetic", "progress=false", "+max_memory.0=2MiB", "headroom=256KiB", *overrides],
        )


def test_plan_only_shows_the_split_and_loads_nothing(tmp_path, fake_gpu, capsys, monkeypatch):
    from offload_core.runner.job import run
    from offload_core.plan import hybrid as planning

    monkeypatch.setattr(planning, "measured_rates", lambda *args: Rates(h2d_bps=1e9, host_bps=1e12))
    fake = fake_gpu(count=1, memory=8 * 2**20)
    run(_compose("hook=prefetch", "storage=pinned_cpu", "hybrid=true", "plan_only=true"), output_dir=tmp_path)
    out = capsys.readouterr().out
    assert "  hybrid: 4 of 5 offloaded units computed on the host" in out
    assert "predicted per token" in out and "copy-only bound" in out
    assert fake.memory_allocated(0) == 0  # nothing was loaded


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["hook=chained"], "hybrid=true streams the other blocks with hook=prefetch, not hook=chained"),
        (["hook=prefetch", "auto=true"], "hybrid=true is not ranked by auto=true"),
    ],
)
def test_hybrid_with_another_policy_is_one_line(overrides, says, tmp_path, fake_gpu):
    from offload_core.errors import ConfigError
    from offload_core.runner.job import run

    fake_gpu(count=1, memory=8 * 2**20)
    with pytest.raises(ConfigError, match=says):
        run(_compose("hybrid=true", *overrides), output_dir=tmp_path)


@pytest.mark.parametrize("rates", ["given", "measured"])
def test_from_pretrained_hybrid_measures_the_split_as_it_dispatches(rates, tmp_path, fake_gpu, monkeypatch):
    """``from_pretrained(..., hybrid=True)``: no plan gave the split, so the policy measures one offloaded block (copy,
    GPU step, host step) and solves it before its module hooks attach; the tokens stay the in-memory model's."""
    import offload_core
    from offload_core.module_hooks.prefetch import hybrid_rates

    if rates == "given":
        monkeypatch.setattr(hybrid_rates, "measure_rates", lambda *args: Rates(h2d_bps=1e9, host_bps=1e12))
    reference = _llama()
    reference.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 320, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=5, do_sample=False)
    fake = fake_gpu(count=1, memory="64MiB")
    model = offload_core.from_pretrained(
        tmp_path / "ckpt",
        offload={"storage": "pinned_cpu", "hybrid": True},
        max_memory={0: "250KiB", "cpu": "64MiB"},
        dtype="float32",
        generation={"max_new_tokens": 5, "prompt_tokens": 5},
    )
    policy = model.offload_state.handle
    split = policy.split
    assert split is not None and split.step_s <= split.copy_only_s
    if rates == "given":  # a host as fast as memory: every offloaded block there
        assert len(split.host) == policy.counters()["host_units"] >= 2
    with torch.no_grad():
        out = model.generate(ids.to(fake.device(0)), max_new_tokens=5, do_sample=False)
    assert torch.equal(out.cpu(), expected)
    assert policy.counters()["host_calls"] == policy.counters()["host_units"] * 4
    model.offload_state.remove()


@pytest.mark.parametrize("policy", ["chained", None])
def test_from_pretrained_hybrid_refuses_another_policy_or_no_gpu(policy, tmp_path, fake_gpu):
    import offload_core
    from offload_core.errors import ConfigError

    fake_gpu(count=1)
    _llama().save_pretrained(tmp_path / "ckpt")
    says = "not 'chained': pass policy='prefetch'" if policy else "this run computes on cpu: leave hybrid out"
    with pytest.raises(ConfigError, match=says):
        offload_core.from_pretrained(
            tmp_path / "ckpt",
            offload={"policy": policy, "hybrid": True, "execution_device": "cpu" if not policy else None},
        )
