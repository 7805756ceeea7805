"""The self draft is the target's own first layers (the same logits as the target cut after them, no copy); prompt
lookup's draft length adapts; the token timer counts the tokens a speculative step adds."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from offload_core.jobs.metrics import TokenTimer
from offload_core.speculative import prepare
from offload_core.speculative.drafts import self_draft

from tests.speculative import models


def test_self_draft_shares_weights_and_equals_the_target_cut_after_k_layers(tmp_path):
    target = AutoModelForCausalLM.from_pretrained(models.target(tmp_path / "t")).eval()
    draft = self_draft(target, 2)
    assert draft.model.layers[1] is target.model.layers[1] and draft.lm_head is target.lm_head
    assert len(draft.model.layers) == 2 and target.config.num_hidden_layers == 4
    with torch.inference_mode():
        got = draft(models.PROMPT).logits
        target.model.config.num_hidden_layers = 2  # transformers' own early exit: layers[:num_hidden_layers]
        expected = target(models.PROMPT).logits
    assert torch.equal(got, expected)


def test_prompt_lookup_drafts_fewer_when_adaptive_and_gives_the_same_tokens(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(models.target(tmp_path / "t")).eval()
    runs = {}
    prompt = torch.tensor([[3, 41, 7, 99, 12, 60, 25, 130] * 5])  # long matches the random model does not follow
    for adaptive in (True, False):
        speculation = prepare({"name": "prompt_lookup", "tokens": 8, "adaptive": adaptive, "min_acceptance": 0}, model)
        with torch.inference_mode():
            out = speculation.generate(prompt, max_new_tokens=16, do_sample=False)
        runs[adaptive] = (out.tolist(), speculation.figures(16))
    assert runs[True][0] == runs[False][0]
    assert runs[False][1]["acceptance_rate"] < 1
    assert runs[True][1]["drafted_tokens"] < runs[False][1]["drafted_tokens"]


def test_token_timer_counts_tokens_not_steps():
    timer = TokenTimer()
    timer(torch.zeros(1, 10, dtype=torch.long), None)
    timer(torch.zeros(1, 14, dtype=torch.long), None)
    timer.stamps = [0.0, 2.0]
    assert timer.decode_tokens_per_s == 2.0


def test_drafting_stops_when_acceptance_is_too_low_and_tokens_stay_the_same(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(models.target(tmp_path / "t")).eval()
    runs = {}
    for floor in (0.0, 0.9):
        speculation = prepare({"name": "self", "layers": 1, "tokens": 3, "min_acceptance": floor, "probe": 2}, model)
        with torch.inference_mode():
            out = speculation.generate(models.PROMPT, max_new_tokens=16, do_sample=False)
        runs[floor] = (out.tolist(), speculation.figures(16))
    assert runs[0.0][0] == runs[0.9][0]
    kept, stopped = runs[0.0][1], runs[0.9][1]
    assert not kept["drafting_stopped"] and stopped["drafting_stopped"]
    assert kept["acceptance_rate"] < 0.9 and stopped["drafted_tokens"] < kept["drafted_tokens"]
    assert stopped["target_passes"] + stopped["accepted_tokens"] == 16
