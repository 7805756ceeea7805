"""The GPU targets a comparison report states: an eager offloaded token is held to the larger of its transfer bound
and the in-memory eager step on the same GPU."""

from __future__ import annotations

import sys

from tests import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from targets import evaluate_targets  # noqa: E402

NAME = "GPU: per-token time <= 1.15 x max(transfer bound, in-memory eager step)"


def _row(token_s: float | None, ideal_s: float) -> dict:
    return {
        "decode_token_mean_s": token_s,
        "ideal_h2d_s_per_token": ideal_s,
        "h2d_token_over_ideal": token_s / ideal_s if token_s and ideal_s else None,
        "peak_gpu_bytes": 1,
        "decode_vs_inmem": None,
        "decode_vs_accelerate": None,
    }


def test_the_bound_is_the_slower_of_the_copies_and_the_in_memory_step():
    medians = {
        "inmem": _row(0.150, 0.0),
        "ours:prefetch:pinned_cpu": _row(0.136, 0.094),  # host-bound: the in-memory step is the bound
        "ours:prefetch:safetensors": _row(0.250, 0.200),  # copy-bound: its copies are
    }
    targets = evaluate_targets(medians, budget_bytes=2, cold=False, gpu=True)[NAME]
    host_bound, copy_bound = targets["ours:prefetch:pinned_cpu"], targets["ours:prefetch:safetensors"]
    assert round(host_bound["value"], 4) == round(0.136 / 0.150, 4) and host_bound["met"]
    assert copy_bound["value"] == 0.250 / 0.200 and not copy_bound["met"]


def test_without_an_in_memory_run_the_copies_alone_bound_it():
    medians = {"ours:prefetch:pinned_cpu": _row(0.136, 0.094)}
    value = evaluate_targets(medians, budget_bytes=2, cold=False, gpu=True)[NAME]["ours:prefetch:pinned_cpu"]["value"]
    assert value == 0.136 / 0.094
