"""A mixture-of-experts model that fits its budget is planned whole, as users ask for the plan: ``python run.py
... plan_only=true`` with every policy keeps 100% in memory and holds nothing back for units in flight."""

from __future__ import annotations

import sys

import pytest
import torch
import transformers

from tests import ROOT, preloaded
from tests.checkpoints import POLICIES, paged_mixtral
from tests.end_to_end.helpers import child_env


def _tokenizer(folder) -> None:
    """A word-level tokenizer over a few words, saved beside the weights (the run reads the prompt as text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "the", "capital", "of", "france", "is", "paris", "?", "what"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)


@pytest.mark.slow  # a process
def test_plan_only_keeps_a_fitting_mixtral_whole_under_every_policy(tmp_path):
    torch.manual_seed(0)
    folder = tmp_path / "mixtral"
    transformers.MixtralForCausalLM(paged_mixtral()).save_pretrained(folder)  # per-expert tensors, 1.3 MiB
    _tokenizer(folder)
    proc = preloaded.run(
        [
            sys.executable,
            "run.py",
            "-m",
            f"hook={','.join(POLICIES)}",
            "model=local",
            f"model.path={folder}",
            "max_memory.cpu=80MB",
            "plan_only=true",
            "progress=false",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for policy in POLICIES:
        assert f"hook={policy}" in out
    assert out.count("100% of the model") == len(POLICIES), out
    assert out.count("reserved for offloaded weights in flight: cpu: 0 B") == len(POLICIES), out
    assert "disk:" not in out and "raise the budget" not in out and "raise max_memory" not in out, out
