"""What a measuring script run in a fresh process starts with: ``anon()`` (its anonymous resident memory, Linux) and
``Peak`` (sampled on a thread every half millisecond from a baseline taken when it starts; ``rise()`` stops it and
gives the peak above that baseline, as run.py's and the benchmarks' figures are). Prepended to the script's own code:
``SAMPLING + textwrap.dedent(...)``; :func:`measured` runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests import ROOT

SAMPLING = textwrap.dedent("""
    import threading as _threading, time as _time

    def anon():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

    class Peak:
        def __init__(self):
            self.base, self.peak, self.done = anon(), 0, _threading.Event()
            self.thread = _threading.Thread(target=self._sample, daemon=True)
            self.thread.start()

        def _sample(self):
            while not self.done.is_set():
                self.peak = max(self.peak, anon())
                _time.sleep(0.0005)

        def rise(self):
            self.done.set()
            self.thread.join()
            return max(self.peak, anon()) - self.base

    def generate_all(model, ids, new):  # greedy, exactly ``new`` tokens a row: the generation the budget planned
        import torch

        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=0)
""")


def measured(script: str, *args: object) -> dict:
    """``script`` run in a fresh Python from the repository's root with ``args``: the JSON object its last line
    prints (the process must exit 0; its stderr's end is the failure's message)."""
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
