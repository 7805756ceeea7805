"""``hybrid=true`` on a real GPU: host blocks computed on the CPU in decoding steps, the others streamed; the tokens
agree with the all-GPU in-memory model (float32: exactly here; bfloat16: mostly, CPU and GPU round differently), the
KV cache of host blocks on the host and the GPU's peak within the budget. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import dispatch_model
from offload_core.module_hooks.prefetch import PrefetchConfig
from offload_core.module_hooks.prefetch.hybrid import HybridPrefetch
from offload_core.planning.hybrid import Rates

from tests import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = LlamaConfig(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
)
MAP = {
    "model.embed_tokens": 0,
    "model.layers.0": 0,
    **{f"model.layers.{i}": "cpu" for i in range(1, 6)},
    "model.norm": 0,
    "model.rotary_emb": 0,
    "lm_head": 0,
}
HOST = ["model.layers.2", "model.layers.4"]


def _model(dtype):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG, dtype=dtype).eval()


@pytest.mark.parametrize("dtype,agree", [(torch.float32, 1.0), (torch.bfloat16, 0.5)])
def test_hybrid_decoding_agrees_with_the_gpu_model(dtype, agree, tmp_path):
    ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(1)).cuda()
    reference = _model(dtype).cuda()
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    del reference
    torch.cuda.empty_cache()
    model = _model(dtype)
    dispatch_model(
        model, MAP, storage="pinned_cpu", policy=HybridPrefetch(PrefetchConfig(), HOST), offload_folder=tmp_path
    )
    where = []
    attention = model.model.layers[2].self_attn.forward

    def watched(*args, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        keys = getattr(cache.layers[2], "keys", None) if cache is not None else None
        where.append(keys.device.type if isinstance(keys, torch.Tensor) else None)
        return attention(*args, **kwargs)

    model.model.layers[2].self_attn.forward = watched
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    counters = model.offload_state.handle.counters()
    assert counters["host_units"] == 2 and counters["host_calls"] == 2 * 15
    assert where[1:] == ["cpu"] * 15  # the decoding steps: layer 2's cache on the host
    new, want = out[0, 12:].tolist(), expected[0, 12:].tolist()
    share = sum(a == b for a, b in zip(new, want)) / len(want)
    print(f"{dtype}: token agreement {share:.2f}")
    assert share >= agree and new[0] == want[0]
    model.offload_state.remove()


def test_a_hybrid_run_stays_in_its_gpu_budget(tmp_path, monkeypatch):
    """The whole run, every offloaded block on the host (rates given: a host as fast as memory): the GPU's peak within
    max_memory.0 (the tokens' agreement is the test above's)."""
    from offload_core.runner.config import register_configs
    from offload_core.runner.job import run
    from offload_core.plan import hybrid as planning

    monkeypatch.setattr(planning, "measured_rates", lambda *args: Rates(h2d_bps=1e9, host_bps=1e12))
    budget = 96 * 2**20
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[
                "model=synthetic",
                "model.preset=small",
                "hook=prefetch",
                "storage=pinned_cpu",
                "dtype=float32",
                "max_new_tokens=8",
                "progress=false",
                "compare_in_memory=true",
                f"+max_memory.0={budget}",
                "max_memory.cpu=200MiB",
                "hybrid=true",
            ],
        )
    result = run(cfg, output_dir=tmp_path)
    print(f"matches in memory: {result.matches_in_memory}")
    assert result.matches_in_memory is not None
    assert result.figures["prefetch"]["host_calls"] > 0
    assert result.figures["peak_gpu_bytes"]["0"] <= budget
