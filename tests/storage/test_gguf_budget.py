"""storage=gguf holds the dequantized copies of the blocks in flight inside ``max_memory.cpu``: every tensor read from a
GGUF file is a copy (dequantized, not a view of the file), so the plan reserves the policy's units in flight; measured
in a fresh process, the run peaks within its budget (a 13B Q4_0 file with ``hook=prefetch`` peaked at 11.1 GB of
anonymous memory on an 8 GB budget while the plan reserved nothing for them)."""

from __future__ import annotations

import sys
import textwrap

import pytest
from gguf import GGMLQuantizationType as T

import offload_core
from tests.gguf_files import write_gguf
from tests.peak_rss import SAMPLING, measured

BUDGET = 96 * 2**20

#: load and run a forward in a fresh process, the peak anonymous RSS sampled every half millisecond from a baseline
#: taken after the imports (as run.py's figures are)
_MEASURE = SAMPLING + textwrap.dedent("""
    import json, sys
    import torch
    import offload_core
    import transformers.models.llama.modeling_llama

    path, budget, policy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    peak = Peak()
    model = offload_core.from_pretrained(path, {"cpu": budget}, {"storage": "gguf", "policy": policy})
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]))
    print(json.dumps({"rise": peak.rise(), "reserved": model.offload_plan.reserve.get("cpu", 0)}))
""")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """A Llama whose float32 blocks (38 MiB each) are large beside the process's own noise, stored as Q4_0."""
    return write_gguf(
        tmp_path_factory.mktemp("gguf-budget") / "llama.gguf", "llama", default=int(T.Q4_0), layers=4, hidden=1024
    )


def test_the_blocks_in_flight_are_reserved_as_the_copies_they_are(path):
    model = offload_core.from_pretrained(path, {"cpu": BUDGET}, {"storage": "gguf", "policy": "align_per_call"})
    try:
        plan = model.offload_plan
        offloaded = [name for name, where in model.hf_device_map.items() if where == "disk"]
        largest = max(  # the largest module's float32 weight: align_per_call's unit in flight
            p.numel() * 4 for n, p in model.named_parameters() if any(n.startswith(o + ".") for o in offloaded)
        )
    finally:
        model.offload_state.release()
    assert offloaded and plan.reserve["cpu"] >= largest > 0  # a dequantized copy of each size offloaded


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("policy", ["prefetch", "align_per_call"])
def test_a_gguf_run_peaks_within_its_cpu_budget(path, policy):
    run = measured(_MEASURE, path, BUDGET, policy)
    assert run["reserved"] > 0
    assert run["rise"] <= BUDGET, f"peak {run['rise'] / 2**20:.1f} MiB over the {BUDGET / 2**20:.0f} MiB budget"
