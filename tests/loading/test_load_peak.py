"""Loading keeps anonymous memory at what it holds: a tensor transformers fuses from per-expert checkpoint tensors
(a Mixtral layer's ``gate_up_proj``) is never built whole beside the memory that keeps it, resident or written to
an offload folder."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
import transformers

import offload_core

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")

# one layer's gate_up_proj, float32: 64 MiB, so that half of it stands clear of the 1 MiB buffer the folder's seal
# hashes its files through
FUSED = 8 * 2 * 2048 * 512 * 4


def _anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


class _Peak:
    """The highest anonymous RSS seen while the block runs, sampled every millisecond."""

    def __enter__(self) -> "_Peak":
        self.peak, self._stop = _anon(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _anon())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon())


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> str:
    config = transformers.MixtralConfig(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mixtral-load")
    transformers.MixtralForCausalLM(config).save_pretrained(path)  # per-expert tensors, as transformers saves them
    return str(path)


@pytest.mark.parametrize(
    ("storage", "budget"),
    [("safetensors", "1GiB"), ("pinned_cpu", "8MiB"), ("memmap", "8MiB")],
    ids=["resident", "memory-store", "offload-folder"],
)
def test_a_fused_tensor_is_not_built_beside_its_copy(mixtral, tmp_path, storage, budget):
    import gc

    gc.collect()
    with torch.no_grad(), _Peak() as seen:
        model = offload_core.from_pretrained(
            mixtral,
            offload={"storage": storage, "offload_folder": tmp_path / "offload", "over_budget": "warn"},
            max_memory={"cpu": budget},
        )  # pinned_cpu holds the disk tier in memory: over the budget, warned
        held = _anon()
    assert seen.peak - held < FUSED // 2, f"loading peaked {(seen.peak - held) / 2**20:.0f} MiB over what it holds"
    ids = torch.tensor([[1, 5, 7, 9]])
    reference = transformers.MixtralForCausalLM.from_pretrained(mixtral)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
