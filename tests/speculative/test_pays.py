"""Prompt lookup checks a draft only where it pays on this machine, from the passes it timed: a pass that checks
drafts costs more than a pass of one token on a CPU, about the same when the pass waits for the disk."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from offload_core.speculative import prepare
from offload_core.speculative.pays import MOST_SKIPPED, DraftValue

from tests.speculative import models


def test_with_nothing_timed_every_draft_is_checked():
    value = DraftValue(prior=0.0)
    assert value.pays(20)
    value.timed(1, 0.04)
    assert value.pays(20)  # no check timed yet: what one costs is unknown


def test_a_rejected_draft_on_a_cpu_is_not_checked_again_until_patience_runs_out():
    value = DraftValue()
    value.timed(1, 0.040)
    value.timed(21, 0.092)  # a check of 20 drafted tokens: 2.3 passes of one
    value.checked(0)
    value.checked(0)  # tokens won per check: 0.25
    decisions = [value.pays(20) for _ in range(8)]
    # skipped once, checked, skipped twice, checked, skipped four times: patience doubles after each check
    assert decisions == [False, True, False, False, True, False, False, False]
    assert value.skipped == 6


def test_patience_is_bounded_and_a_winning_check_restores_it():
    value = DraftValue()
    value.timed(1, 0.04)
    value.timed(11, 0.08)
    value.checked(0)
    value.checked(0)
    checks = [i for i in range(200) if value.pays(10)]
    gaps = [b - a - 1 for a, b in zip(checks, checks[1:])]
    assert max(gaps) == MOST_SKIPPED
    value.checked(10)  # the text starts copying: 10 accepted
    assert value.patience == 1 and value.pays(10)


def test_waiting_for_the_disk_a_check_costs_about_a_pass_and_drafts_go_on():
    value = DraftValue()
    value.timed(1, 0.50)
    value.timed(21, 0.52)  # the pass waits for its weights: 20 more tokens cost little
    for _ in range(3):
        value.checked(0)
    assert value.won < 0.2 and all(value.pays(20) for _ in range(5))


def test_a_check_of_a_size_not_timed_is_costed_as_the_nearest_timed():
    value = DraftValue()
    value.timed(1, 0.04)
    value.timed(3, 0.05)
    value.timed(21, 0.10)
    value.checked(0)
    value.checked(0)
    assert value.pays(3)  # nearest timed: 3 tokens, 0.05 s: 1.25 tokens expected pays for it
    assert not value.pays(18)  # nearest timed: 21 tokens, 0.10 s


def test_skipped_drafts_give_the_same_tokens_and_are_counted(tmp_path, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(models.target(tmp_path / "t")).eval()
    prompt = torch.tensor([[3, 41, 7, 99, 12, 60, 25, 130] * 5])  # long matches the random model does not follow
    with torch.inference_mode():
        plain = model.generate(prompt, max_new_tokens=16, do_sample=False).tolist()
        speculation = prepare({"name": "prompt_lookup", "tokens": 8, "min_acceptance": 0}, model)
        # as on a CPU: a pass that checks drafts costs twice a pass of one token
        monkeypatch.setattr(DraftValue, "_cost", lambda self, tokens: 2.0 * self.seconds.get(1, 0.0) or None)
        out = speculation.generate(prompt, max_new_tokens=16, do_sample=False).tolist()
    figures = speculation.figures(16)
    assert out == plain
    assert figures["drafts_skipped"] > 0


def test_a_replayed_run_checks_the_drafts_the_first_checked():
    first = DraftValue()
    first.timed(1, 0.04)
    first.timed(21, 0.09)
    first.checked(0)
    made = [first.pays(20) for _ in range(6)]
    again = DraftValue(replay=first.decisions)  # nothing timed: left alone, it would check every draft
    assert [again.pays(20) for _ in range(6)] == made and again.decisions == first.decisions
    assert again.pays(20) and again.decisions.endswith("c")  # past the replayed decisions: checked
