"""An offloaded model's outputs against transformers' in-memory model's: the logits and the greedy tokens, bit for
bit."""

from __future__ import annotations

import torch


def assert_same_outputs(model, reference, ids: torch.Tensor, tokens: int = 4) -> None:
    """``model`` gives ``reference``'s logits for ``ids`` and generates its ``tokens`` greedy tokens after them."""
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
        want = reference.generate(ids, max_new_tokens=tokens, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=tokens, do_sample=False), want)
