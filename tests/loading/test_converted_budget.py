"""A run in another dtype than its checkpoint's stays within ``max_memory.cpu``: a bfloat16 Llama run in float32 with
its LM head offloaded to an offload folder, loaded through ``from_pretrained`` and generating in a fresh process,
peaks within the budget (the 0.3b preset's ``storage=memmap`` run went over it by converting its whole LM head at
once while loading, beside the weights already loaded)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
import transformers

from tests.peak_rss import SAMPLING, measured

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status"),
]

BUDGET = 64 * 2**20
#: what a run may take over ``max_memory.cpu``: nothing. docs/concepts.md: the cpu budget bounds the peak of this
#: process's anonymous memory above its baseline with a memmap or safetensors store, "with no allowance on top, since
#: the runtime's own slack ... is held inside the budget"
ALLOWANCE = 0
GENERATION = {"max_new_tokens": 8, "batch_size": 1, "prompt_tokens": 30}
LM_HEAD = 32000 * 256 * 4  # float32 bytes of the checkpoint's LM head (and of its embedding)

#: load and generate in a fresh process, the peak anonymous RSS sampled every half millisecond from a baseline taken
#: after the imports (as run.py's and the benchmarks' figures are)
_MEASURE = SAMPLING + textwrap.dedent("""
    import json, sys
    import torch
    import offload_core
    import transformers.models.llama.modeling_llama

    path, budget, storage, folder, generation = sys.argv[1:4] + [sys.argv[4], json.loads(sys.argv[5])]
    torch.set_num_threads(1)
    ids = torch.randint(3, 32000, (1, generation["prompt_tokens"]), generator=torch.Generator().manual_seed(0))
    peak = Peak()
    options = {"storage": storage, "execution_device": "cpu", "offload_folder": folder}
    model = offload_core.from_pretrained(path, {"cpu": int(budget)}, options, dtype="float32", generation=generation)
    loaded = anon() - peak.base
    out = generate_all(model, ids, generation["max_new_tokens"])
    rise = peak.rise()
    devices = model.offload_plan.summary["devices"]
    print(json.dumps({
        "rise": rise,
        "loaded": loaded,
        "new_tokens": out.shape[1] - ids.shape[1],
        "cpu_bytes": devices.get("cpu", {}).get("bytes", 0),
        "offloaded": sorted(name for name, where in model.hf_device_map.items() if where == "disk"),
    }))
""")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A bfloat16 Llama of 44 MB (89 MB in float32, its embedding and LM head 31 MiB each), in three shards: the LM
    head, last, is written to the offload folder after the resident weights are loaded."""
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("converted-budget")
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="20MB")
    return path


@pytest.mark.parametrize("storage", ["memmap", "safetensors"])
def test_a_float32_run_of_a_bfloat16_checkpoint_peaks_within_the_cpu_budget(checkpoint, tmp_path, storage):
    run = measured(_MEASURE, checkpoint, BUDGET, storage, tmp_path / "offload", json.dumps(GENERATION))
    print(storage, {k: v for k, v in run.items() if k != "offloaded"})
    assert run["new_tokens"] == GENERATION["max_new_tokens"]
    assert "lm_head" in run["offloaded"]
    if storage == "memmap":  # the LM head in float32, converted whole beside what the plan keeps, would go over
        assert run["cpu_bytes"] + LM_HEAD > BUDGET
    assert run["rise"] <= BUDGET + ALLOWANCE, f"peak anonymous rise {run['rise'] / 2**20:.1f} MiB"
