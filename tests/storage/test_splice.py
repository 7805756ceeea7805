"""A tensor spliced from parts of several files maps the pages most of its bytes can map; what it copies instead
(edges, parts that fall otherwise in their pages) is what ``copied_bytes`` says, and the plan holds it back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import offload_core
from offload_core import init_empty_weights
from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.converted import convert_checkpoint
from offload_core.loading.dispatch import resolve_strategy
from offload_core.plan.reserve import splice_copies
from offload_core.storage.splice import PAGE, Part, Spliced, copied_bytes
from tests.checkpoints import paged_mixtral
from tests.maps import file_backed

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="splicing maps files: Linux only")


def _write(path: Path, lead: int, chunks: list[torch.Tensor]) -> list[tuple[int, int]]:
    """``chunks`` written one after the other after ``lead`` bytes; their byte ranges."""
    ranges, offset = [], lead
    with open(path, "wb") as out:
        out.write(b"\0" * lead)
        for chunk in chunks:
            data = chunk.numpy().tobytes()
            out.write(data)
            ranges.append((offset, offset + len(data)))
            offset += len(data)
    return ranges


def test_the_pages_most_bytes_share_are_mapped_and_the_rest_is_counted_as_copied(tmp_path):
    # row 0 lies in one file, rows 1-3 in another that places them otherwise in their pages: the first row's file
    # would have decided before; now the three rows map, and row 0 is the copy
    width = 2 * PAGE // 4
    want = torch.randn(4, width)
    few, many = tmp_path / "few.bin", tmp_path / "many.bin"
    (first,) = _write(few, 200, [want[0]])
    rest = _write(many, 104, [want[1], want[2], want[3]])
    parts = [Part((0,), few, *first)] + [Part((i + 1,), many, *r) for i, r in enumerate(rest)]
    spliced = Spliced.build(want.shape, torch.float32, parts)
    assert spliced is not None
    spliced.copy_edges(list(want))
    assert torch.equal(spliced.tensor, want)
    mapped = {path: file_backed(spliced.address, spliced.nbytes, path) for path in (few, many)}
    assert mapped[few] == 0 and mapped[many] >= 3 * PAGE  # each of the three rows maps its interior page at least
    assert copied_bytes(want.shape, torch.float32, parts) == spliced.nbytes - mapped[many]


def test_the_plan_holds_back_what_the_spliced_tensors_copy(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "ckpt"
    AutoModelForCausalLM.from_config(paged_mixtral(2)).to(torch.bfloat16).save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    plans = {}
    for store in ("safetensors", "memmap"):
        model = offload_core.from_pretrained(
            path,
            offload={
                "device_map": {"": "disk"},
                "storage": store,
                "policy": "align_per_call",
                "offload_folder": tmp_path / "off",
            },
            dtype=torch.bfloat16,
        )
        try:
            plans[store] = model.offload_plan.reserve.get("cpu", 0)
            if store == "safetensors":
                held = model.offload_state.store
                with torch.no_grad():
                    model(torch.ones(1, 3, dtype=torch.long))
                copied = 0
                for name in held:
                    spliced = held.spliced(name)
                    if spliced is not None:
                        files = {piece.part.path for piece in spliced.pieces}
                        backed = sum(file_backed(spliced.address, spliced.nbytes, f) for f in files)
                        copied += spliced.nbytes - backed
        finally:
            model.offload_state.remove()
    assert copied > 0
    assert plans["safetensors"] - plans["memmap"] >= copied
    # load_checkpoint_and_dispatch plans with the checkpoint already converted to the model's names: the same bytes
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(paged_mixtral(2))
    opened, store = Checkpoint.open(path), resolve_strategy("storage", "safetensors")
    held_back = splice_copies(meta, opened, store, torch.bfloat16)
    assert held_back == splice_copies(meta, convert_checkpoint(meta, opened), store, torch.bfloat16) >= copied
