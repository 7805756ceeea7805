"""Mutation testing of the core with mutmut, one group of modules at a time, and its report.

    nice python bench/mutation.py planning integrity sizes prefetch experts > bench/results/mutation.md

Each group runs in a scratch copy of this working tree (mutmut rewrites the files it mutates under ``mutants/``),
against the quick subset (``-m "not slow"``): mutmut first records which tests reach each function, then runs only
those tests for each mutant of that function. A mutant is killed when a test fails (or times out); it survives when
every test that reaches it passes. Slow (tens of minutes a group on two cores) and not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

GROUPS: dict[str, list[str]] = {
    "planning": [
        "offload_core/planning/device_map.py",
        "offload_core/planning/fill.py",
        "offload_core/planning/budgets.py",
        "offload_core/planning/reservation.py",
        "offload_core/planning/batch_memory.py",
        "offload_core/planning/request.py",
    ],
    "integrity": [
        "offload_core/storage/folder.py",
        "offload_core/storage/folder_record.py",
        "offload_core/storage/folder_guard.py",
    ],
    "sizes": ["offload_core/planning/sizing.py", "offload_core/values.py"],
    "prefetch": [
        "offload_core/module_hooks/prefetch/pool.py",
        "offload_core/module_hooks/prefetch/layout.py",
        "offload_core/module_hooks/prefetch/prefetcher.py",
    ],
    "experts": ["offload_core/module_hooks/experts/loader.py"],
}

#: mutmut with its call-stack bookkeeping tolerant of worker threads: mutmut 3.8.1 records which function calls which
#: in a ContextVar and raises LookupError resetting it in a thread-pool thread (the prefetch reader calling a store)
_MUTMUT = """
import sys
from mutmut import core
from mutmut.__main__ import cli

reset = core.MutmutCallStack.reset.__func__


def tolerant(cls, token):
    try:
        reset(cls, token)
    except (LookupError, ValueError):
        pass


core.MutmutCallStack.reset = classmethod(tolerant)
sys.argv[0] = "mutmut"
cli()
"""

#: mutmut's exit codes for a mutant (mutmut/__main__.py status_by_exit_code)
KILLED, SURVIVED = {1, 3, 36, 24, -24}, {0}


def scratch_copy(into: Path) -> Path:
    """This working tree without its virtualenv, caches and earlier mutants."""
    ignore = shutil.ignore_patterns(
        ".venv", "mutants", "__pycache__", ".git", "*.egg-info", ".pytest_cache", ".hypothesis", "outputs", "multirun"
    )
    shutil.copytree(ROOT, into, ignore=ignore)
    return into


def configure(tree: Path, paths: list[str], pytest_args: list[str], tests: list[str]) -> None:
    pyproject = tree / "pyproject.toml"
    text = pyproject.read_text()
    text += (
        "\n[tool.mutmut]\n"
        'source_paths = ["offload_core"]\n'
        f"only_mutate = {json.dumps(paths)}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        'also_copy = [".ci/", "conf/", "plugins/", "run.py", "examples/", "bench/", "README.md", "conftest.py", '
        '"docs/", "mkdocs.yml"]\n'
        f"pytest_add_cli_args = {json.dumps(pytest_args)}\n"
    )
    pyproject.write_text(text)


def counts(tree: Path) -> dict[str, Counter]:
    """Killed / survived / other per mutated file, from mutmut's ``.meta`` files."""
    out: dict[str, Counter] = {}
    for meta in sorted((tree / "mutants").rglob("*.py.meta")):
        name = str(meta.relative_to(tree / "mutants"))[: -len(".meta")]
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        tally = Counter()
        for code in codes.values():
            tally[
                "killed"
                if code in KILLED
                else "survived"
                if code in SURVIVED
                else "no tests"
                if code == 33
                else "not run"
                if code is None
                else f"exit {code}"
            ] += 1
        out[name] = tally
    return out


def run_group(
    name: str, children: int, keep: Path | None, minutes: float, only: list[str], tests: list[str]
) -> tuple[dict[str, Counter], float, str]:
    with tempfile.TemporaryDirectory(prefix=f"mutation-{name}-") as scratch:
        tree = scratch_copy(Path(scratch) / "tree")
        # mutmut's trampolines make a mutated file longer than the line limit the layering test holds sources to, and
        # neither ruff-clean (imports below code) nor ruff-formatted: those tests do not hold on the mutated tree
        configure(
            tree,
            GROUPS[name],
            [
                "-n",
                "0",
                "-m",
                "not slow",
                "-p",
                "no:cacheprovider",
                "-x",
                "-q",
                "--deselect",
                "tests/test_layering.py::test_no_python_file_is_over_the_line_limit",
                "--deselect",
                "tests/test_style.py::test_ruff_check_passes",
                "--deselect",
                "tests/test_style.py::test_ruff_format_leaves_the_tree_as_it_is",
            ],
            tests,
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        start = time.monotonic()
        log = open(Path(scratch) / "mutmut.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-c", _MUTMUT, "run", "--max-children", str(children), *only],
            cwd=tree,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=minutes * 60)
        except subprocess.TimeoutExpired:  # bounded: what ran is reported, the rest counts as "not run"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        took = time.monotonic() - start
        results = subprocess.run(
            [sys.executable, "-m", "mutmut", "results"], cwd=tree, env=env, capture_output=True, text=True, timeout=600
        ).stdout
        # every mutant not judged (not run in the bound, or left out by --only) is listed too: only the judged ones
        survivors = "\n".join(line.strip() for line in results.splitlines() if not line.endswith(": not checked"))
        if keep is not None and (tree / "mutants").is_dir():
            shutil.copytree(tree / "mutants", keep / name, dirs_exist_ok=True)
        log.close()
        if keep is not None:
            shutil.copy(Path(scratch) / "mutmut.log", keep / f"{name}.log")
        if not counts(tree) or not any(t["killed"] + t["survived"] for t in counts(tree).values()):
            raise SystemExit(
                f"mutmut failed for {name} (exit {proc.returncode}): "
                f"{(Path(scratch) / 'mutmut.log').read_text()[-3000:]}"
            )
        return counts(tree), took, survivors


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("groups", nargs="*", default=list(GROUPS), choices=list(GROUPS))
    parser.add_argument("--max-children", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--minutes", type=float, default=60, help="stop a group after this long (default 60)")
    parser.add_argument("--keep", type=Path, help="copy each group's mutants/ here (to inspect survivors)")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PATTERN",
        help="run only the mutants whose name matches this glob (mutmut's names, such as "
        "'*pool_shape*' or '*BlockPool*acquire*'; repeatable); the others count as not run",
    )
    parser.add_argument(
        "--tests",
        action="append",
        metavar="PATH",
        help="the tests mutmut selects from (default tests/; repeatable): fewer make a quicker, weaker check",
    )
    args = parser.parse_args()
    print("| group | module | killed | survived | other | killed share |\n|---|---|---|---|---|---|")
    notes = []
    for group in args.groups:
        per_file, took, survivors = run_group(
            group, args.max_children, args.keep, args.minutes, args.only, args.tests or ["tests/"]
        )
        total = Counter()
        for name, tally in per_file.items():
            total += tally
            other = sum(v for k, v in tally.items() if k not in ("killed", "survived"))
            judged = tally["killed"] + tally["survived"]
            share = f"{100 * tally['killed'] / judged:.0f}%" if judged else "-"
            print(f"| {group} | {name} | {tally['killed']} | {tally['survived']} | {other} | {share} |", flush=True)
        judged = total["killed"] + total["survived"]
        share = f"{100 * total['killed'] / judged:.0f}%" if judged else "-"
        print(
            f"| **{group}** | all | {total['killed']} | {total['survived']} | "
            f"{sum(total.values()) - judged} | **{share}** |",
            flush=True,
        )
        notes.append(f"### {group} ({took / 60:.0f} min): survivors\n\n```\n{survivors.strip()}\n```\n")
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
