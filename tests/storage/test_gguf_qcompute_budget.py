"""``storage.compute=quantized`` packs a weight a pass of rows at a time, and loading reads a resident GGUF tensor into
the memory that holds it, so no whole copy of a tensor is made beside what the plan holds; measured in a fresh process,
a quantized-compute run peaks within its cpu budget (a 13B Q4_0 file peaked at 8.28 GB of anonymous memory on an 8 GB
budget, the 1B preset at 0.84 GB on 800 MB)."""

from __future__ import annotations

import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.gguf_checkpoint import gguf_config, naming_model
from offload_core.loading.gguf_qcompute import compute_quantized
from offload_core.storage.base import read_tensor
from offload_core.storage.gguf import qlinear
from offload_core.storage.gguf.qlinear import PARTS, QuantSpec, pack_into
from offload_core.storage.gguf.rates import random_blocks
from tests.gguf_files import write_gguf
from tests.peak_rss import SAMPLING, measured


def _pack(raw: torch.Tensor, spec: QuantSpec) -> tuple[dict[str, torch.Tensor], int]:
    """Both packed tensors of the weight, and the peak of numpy's memory the packing took beside them."""
    outs = {part: torch.empty(spec.part_spec(part)[0], dtype=spec.part_spec(part)[1]) for part in PARTS}
    tracemalloc.start()
    try:
        for part in PARTS:
            pack_into(raw, spec, part, outs[part])
        return outs, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind, ordered", [(int(T.Q4_0), False), (int(T.Q4_K), True), (int(T.Q8_0), False)])
def test_a_weight_is_packed_a_pass_of_rows_at_a_time_into_the_same_bytes(kind, ordered, monkeypatch):
    """A weight of 8M elements (4 MiB packed as int4): its passes take at most 3 bytes per pass element (the int4
    layout's values and pairs, a reordered slice of blocks; Q8_0's float32 values, a quarter as many), and give the
    bytes one pass over the whole weight gives (which takes 12 MiB to 32 MiB of temporaries)."""
    out_features, in_features = 4096, 2048
    raw = random_blocks(kind, out_features * in_features, seed=kind)
    order = tuple(np.random.default_rng(0).permutation(out_features).tolist()) if ordered else None
    spec = QuantSpec(kind, out_features, in_features, order)
    packed, peak = _pack(raw, spec)
    assert peak <= 3 * qlinear.PASS_ELEMENTS < out_features * in_features // 2
    monkeypatch.setattr(qlinear, "PASS_ELEMENTS", out_features * in_features * 4)
    whole, whole_peak = _pack(raw, spec)
    assert whole_peak > 4 * peak
    assert all(torch.equal(packed[part], whole[part]) for part in PARTS)


def test_loading_reads_a_gguf_tensor_into_the_memory_that_holds_it(tmp_path, monkeypatch):
    """A resident packed tensor, or one dequantized as it lies, is read into its allocation, with ``get``'s bytes
    (``get`` built it whole beside it: a fully resident 1B-shaped Q4_0 file peaked 0.29 GB over its 0.65 GB budget
    as its float32 embedding loaded); llama's q of a type left exact still goes through transformers' processor."""
    path = write_gguf(tmp_path / "llama.gguf", "llama", {"attn_q": int(T.Q5_0)}, default=int(T.Q4_0))
    with Checkpoint.open(path) as opened:
        checkpoint = compute_quantized(naming_model(gguf_config(path)), opened, torch.float32)
        get, built = checkpoint.get, []
        monkeypatch.setattr(checkpoint, "get", lambda key: built.append(key) or get(key))
        for key in sorted(checkpoint.sources):
            held = read_tensor(checkpoint, key, None, False, lambda shape, kind, offset: torch.empty(shape, dtype=kind))
            assert held.dtype == get(key).dtype and torch.equal(held, get(key)), key
    assert (
        any(key.endswith(".qweight") for key in checkpoint.sources)
        and "model.embed_tokens.weight" in checkpoint.sources
    )
    assert built == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(3)]


#: load, run a forward and generate in a fresh process, the peak anonymous RSS sampled every half millisecond from a
#: baseline taken after the imports (as run.py's figures are)
_MEASURE = SAMPLING + textwrap.dedent("""
    import json, sys
    import torch
    import offload_core
    import transformers.models.llama.modeling_llama
    from offload_core.registry.manager import get_registry

    path, budget = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    ids = torch.tensor([[256, 5, 77, 100, 258, 259, 33, 40]])
    peak = Peak()
    storage = get_registry().create("storage", "gguf", {"compute": "quantized"})
    model = offload_core.from_pretrained(path, {"cpu": budget}, {"storage": storage, "policy": "prefetch"})
    with torch.no_grad():
        model(ids)
    out = generate_all(model, ids, 4)
    print(json.dumps({
        "rise": peak.rise(),
        "new_tokens": out.shape[1] - ids.shape[1],
        "reserved": model.offload_plan.reserve.get("cpu", 0),
        "offloaded": sorted(name for name, where in model.hf_device_map.items() if where == "disk"),
    }))
""")


#: per GGML type: the model's hidden size, and the budget. Q4_0's MLP weights (19M elements) took 27 MiB each to pack
#: whole, more than the budget's headroom (a quarter of it), beside one layer in flight (51 MiB packed): 90 MB at the
#: peak before, 63 MB now; Q8_0's (8M elements) three float32 copies of themselves: 115 MB before, 50 MB now
CASES = {"Q4_0": (3072, 76 * 2**20), "Q8_0": (2048, 64 * 2**20)}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_quantized_compute_run_peaks_within_its_cpu_budget(tmp_path, kind):
    hidden, budget = CASES[kind]
    path = write_gguf(tmp_path / "llama.gguf", "llama", default=int(T[kind]), layers=2, hidden=hidden)
    run = measured(_MEASURE, path, budget)
    assert run["new_tokens"] == 4
    assert "model.layers" in run["offloaded"] and run["reserved"] > 0
    assert run["rise"] <= budget, f"peak {run['rise'] / 2**20:.1f} MiB over the {budget / 2**20:.0f} MiB budget"
