"""Plan reports: predicted bytes per token match what the policies measure, the plan text and the placement picture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from offload_core.loading.dispatch import load_checkpoint_and_dispatch
from offload_core.loading.empty import init_empty_weights
from offload_core.planning import compute_module_sizes, summarize_device_map
from offload_core.registry.manager import build_registry
from offload_core.plan.make import predicted_bytes_per_token
from offload_core.plan.report import plan_text, plot_placement
from offload_core.testing import tiny_tied_llama

REGISTRY = build_registry(load_entry_points=False)
CPU = torch.device("cpu")
POLICIES = [
    ("align_per_call", {}),
    ("align_per_call", {"granularity": "block"}),
    ("chained", {}),
    ("functional_call", {}),
    ("prefetch", {}),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied")
    config, _ = tiny_tied_llama(path)
    return path, config


def _empty(config):
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config).eval()


# embeddings (tied with the head) and a block on disk: the tied weight is read by two modules per forward
DEVICE_MAP = {
    "model.embed_tokens": "disk",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p[0] + "-".join(["", *p[1].values()]))
def test_prediction_matches_measured_bytes_per_token(checkpoint, policy, tmp_path):
    path, config = checkpoint
    name, options = policy
    model = _empty(config)
    built = REGISTRY.create("policy", name, {"name": name, **options})
    # bfloat16: every weight is used mapped in place (a float32 weight off the alignment this machine's kernels
    # care about is copied into prefetch's pool, where the head borrows the tied embedding and moves nothing)
    predicted = predicted_bytes_per_token(model, DEVICE_MAP, built, CPU, torch.bfloat16)
    load_checkpoint_and_dispatch(
        model,
        path,
        DEVICE_MAP,
        storage="memmap",
        policy=built,
        dtype=torch.bfloat16,
        offload_folder=tmp_path / "off",
        progress=False,
    )
    ids = torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(0))
    state = model.offload_state
    state.stats.reset()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    state.remove()
    assert predicted > 0
    assert state.stats.bytes == 3 * predicted


def _policy(name):
    return REGISTRY.create("policy", name, {"name": name})


def test_nothing_offloaded_predicts_zero(checkpoint):
    _, config = checkpoint
    assert predicted_bytes_per_token(_empty(config), {"": "cpu"}, _policy("align_per_call"), CPU, None) == 0


def test_cpu_counts_as_offloaded_on_a_gpu_run(checkpoint):
    _, config = checkpoint
    model = _empty(config)
    on_cpu = predicted_bytes_per_token(model, {"": "cpu"}, _policy("align_per_call"), torch.device("cuda:0"), None)
    assert on_cpu >= compute_module_sizes(model)[""]


def test_chained_with_one_offloaded_block_keeps_it(checkpoint):
    _, config = checkpoint
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "cpu",
        "model.layers.3": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    model = _empty(config)
    assert predicted_bytes_per_token(model, device_map, _policy("chained"), CPU, None) == 0
    assert (
        predicted_bytes_per_token(model, device_map, _policy("align_per_call"), CPU, None)
        == compute_module_sizes(model)["model.layers.1"]
    )


def test_plan_text_groups_keys_by_device(checkpoint):
    _, config = checkpoint
    model = _empty(config)
    summary = summarize_device_map(model, DEVICE_MAP, {"cpu": 10**6}, dtype=torch.float32)
    text = plan_text(summary, {"reserve": {"cpu": 4096}, "headroom": 2**20}, 123456, device_map=DEVICE_MAP)
    lines = text.splitlines()
    assert lines[0].strip().startswith("cpu:") and "budget" in lines[0]
    assert "model.layers.0, model.layers.2, model.norm" in text
    assert "model.embed_tokens, model.layers.1, model.layers.3, lm_head" in text
    assert "reserved for offloaded weights in flight: cpu: 4.00 KiB" in text
    assert "predicted bytes moved per generated token: 120.56 KiB" in text


def test_plan_text_folds_runs_of_blocks(checkpoint):
    _, config = checkpoint
    model = _empty(config)
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "cpu",
        "model.layers.2": "cpu",
        "model.layers.3": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    summary = summarize_device_map(model, device_map, None)
    assert "model.layers.0-2" in plan_text(summary, {"reserve": {}}, None, device_map=device_map)


@pytest.mark.slow  # matplotlib's first figure; test_runner's plan-only run also draws one
def test_plot_placement_writes_a_png(checkpoint, tmp_path):
    _, config = checkpoint
    model = _empty(config)
    out = plot_placement(model, {**DEVICE_MAP, "model.layers.0": 0}, compute_module_sizes(model), tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_policy_without_hints_is_predicted_per_block_and_read_once_per_forward(checkpoint):
    _, config = checkpoint
    model = _empty(config)
    per_block = predicted_bytes_per_token(
        model,
        DEVICE_MAP,
        REGISTRY.create("policy", "align_per_call", {"name": "align_per_call", "granularity": "block"}),
        CPU,
        None,
    )
    from offload_core.registry.contracts import Policy

    class NoHints(Policy):  # a third-party policy that declares no capability: the contract's defaults
        def attach(self, model, context):
            raise NotImplementedError

    assert predicted_bytes_per_token(model, DEVICE_MAP, NoHints(None), CPU, None) == per_block > 0

    class KeepsEverything(NoHints):  # one that says it moves nothing after the first token
        def predict_moved(self, unit_bytes):
            return 0

    assert predicted_bytes_per_token(model, DEVICE_MAP, KeepsEverything(None), CPU, None) == 0
