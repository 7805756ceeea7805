"""Ctrl-C in the middle of an answer, as a user presses it (SIGINT to the process): the tokens generated so far are
printed and kept in ``metrics.json``, marked as interrupted, they are the first tokens of the uninterrupted answer, the
run's temporary offload folder is removed, and the run exits with the interrupt's code in one line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

from offload_core.loading import sources
from offload_core.storage.folder import INDEX
from tests import ROOT
from tests.end_to_end.helpers import child_env, cli, run_args, wait_for_line

# announces on stdout when the third token is stamped, so the test interrupts mid-answer
_ANNOUNCING = textwrap.dedent("""
    import sys
    from offload_core.jobs.metrics import TokenTimer
    real = TokenTimer.__call__

    def stamped(self, input_ids, scores, **kwargs):
        done = real(self, input_ids, scores, **kwargs)
        if len(self.stamps) == 3:
            print("THREE TOKENS", flush=True)
        return done

    TokenTimer.__call__ = stamped
    from offload_core.runner.cli import hydra_main
    sys.argv = ["run.py", *sys.argv[1:]]
    hydra_main()
""")


def test_ctrl_c_mid_answer_prints_and_keeps_the_partial_answer(tmp_path, capsys):
    tiny = sources.synthetic_checkpoint(**sources.synthetic_preset("tiny"))
    run, scratch = tmp_path / "run", tmp_path / "tmp"  # the run's temporary files: its offloaded weights
    scratch.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _ANNOUNCING,
            *run_args(tiny),
            "max_new_tokens=1500",
            "progress=false",
            f"hydra.run.dir={run}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**child_env(), "TMPDIR": str(scratch)},
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's foreground job
    )
    try:
        wait_for_line(proc, "THREE TOKENS")
        assert any((p / INDEX).exists() for p in scratch.glob("offload_core-*")), "no temporary store to remove"
        proc.send_signal(signal.SIGINT)
        proc._line_reader[0].join(timeout=60)  # stdout closes as the process exits
        proc.wait(timeout=60)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert proc.returncode == 130, err
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["interrupted"] is True and metrics["max_new_tokens"] == 1500
    kept = metrics["token_ids"]
    assert 3 <= len(kept) < 1500 and metrics["generated_tokens"] == len(kept)
    assert metrics["text"] == " ".join(map(str, kept))  # the synthetic model has no tokenizer: its ids are its text
    lines = err.strip().splitlines()
    assert lines[-2] == (
        f"offload_core: interrupted after {len(kept)} of 1500 new tokens: the partial answer is above and in "
        f'{run / "metrics.json"} ("interrupted": true)'
    )
    assert lines[-1] == "offload_core: interrupted (Ctrl-C); temporary files were removed"
    assert "Traceback" not in err
    assert not list(scratch.glob("offload_core-*"))
    printed = list(proc._line_reader[1].queue)  # what it printed after the third token (None: the end of stdout)
    assert f"{metrics['text']}\n" in printed
    # the same run, not interrupted, starts with the kept tokens
    code, _ = cli([*run_args(tiny), f"max_new_tokens={len(kept)}"], tmp_path, capsys)
    assert code == 0
    assert json.loads((tmp_path / "hydra" / "metrics.json").read_text())["token_ids"] == kept
