"""A budget the plan cannot hold (the policy's layers in flight are larger than it): ``run.py`` refuses it in one error
line naming by how much and what to change (the default, ``over_budget=refuse``); ``over_budget=warn`` runs over it,
a warning line saying so, and a value that is neither is one line too (those two command lines run in this process)."""

from __future__ import annotations

import sys

import pytest

from tests import ROOT, preloaded
from tests.checkpoints import Saved
from tests.end_to_end.helpers import child_env, cli_said


@pytest.mark.slow  # a process
def test_a_budget_smaller_than_the_layers_in_flight_is_refused_or_run_over_warned(tmp_path, capsys):
    moe = Saved("mixtral", tmp_path / "moe")
    command = [
        sys.executable,
        "run.py",
        "model=local",
        "model.tokenizer=bytes",
        f"model.path={moe.path}",
        "hook=prefetch",
        "storage=safetensors",
        "max_memory.cpu=200KiB",
        "headroom=0",
        "execution_device=cpu",
        "plan_only=true",
        "progress=false",
    ]

    code, out, err = cli_said([*command[2:], "over_budget=warn"], tmp_path / "warn", capsys)
    assert code == 0, err[-2000:]
    said = out + err
    assert "hook=prefetch holds " in said and "over max_memory.cpu=200.00 KiB: the run will go over it by" in said
    refused = preloaded.run(
        [*command, f"hydra.run.dir={tmp_path / 'refused'}"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("offload_core: error: hook=prefetch holds "), refused.stderr[-2000:]
    assert "the run would go over it by" in lines[0] and "raise max_memory.cpu to at least" in lines[0]
    code, _, err = cli_said([*command[2:], "over_budget=maybe"], tmp_path / "maybe", capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and lines == ["offload_core: error: over_budget='maybe' is not one of warn, refuse"]
