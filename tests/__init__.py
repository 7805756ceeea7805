"""The test suite, one folder per package folder plus end_to_end/; ROOT is the repository root that tests run run.py and
read conf/ from."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
