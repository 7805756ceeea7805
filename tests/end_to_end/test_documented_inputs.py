"""What the docs say about the inputs users bring is what the process does: each troubleshooting row about a comma or
an apostrophe in a swept prompt, a folder without its tokenizer, a Hub repo id the cache lacks and a bad size is read
from docs/troubleshooting.md (its input, its message with ``…`` for what the message fills in) and checked against
``python run.py``'s one error line (the sizes' and the typed prompt's command lines run in this process); a Hugging
Face cache snapshot read through its own links, as the table says, is run."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT, preloaded
from offload_core.runner.cli import hydra_main
from tests.end_to_end.helpers import cli

#: a fast model and plan for the runs whose input is only the prompt or a size
SMALL = ["model=synthetic", "model.preset=tiny", "plan_only=true", "headroom=0", "progress=false"]


def table_rows(page: str) -> list[list[str]]:
    """Every row of every Markdown table of ``docs/<page>``, as its cells (``\\|`` kept inside a cell)."""
    rows = []
    for line in (ROOT / "docs" / page).read_text(encoding="utf-8").splitlines():
        if line.startswith("|") and not re.fullmatch(r"[|\-: ]+", line):
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def table_row(first_cell: str, page: str = "troubleshooting.md") -> list[str]:
    """The one row of ``docs/<page>`` whose first cell holds ``first_cell``."""
    found = [row for row in table_rows(page) if first_cell in row[0]]
    assert len(found) == 1, f"docs/{page} has {len(found)} rows whose first cell holds {first_cell!r}; expected one"
    return found[0]


def documented(first_cell: str, page: str = "troubleshooting.md") -> list[str]:
    """The row whose first cell holds ``first_cell``: its first cell, then the messages (code spans) of its second."""
    row = table_row(first_cell, page)
    return [row[0], *re.findall(r"`([^`]+)`", row[1])]


def matches(line: str, message: str) -> bool:
    """Whether ``line`` holds ``message``'s fixed parts, in order (``…`` or ``...`` stands for what it fills in)."""
    position = 0
    for part in (p.strip() for p in re.split(r"…|\.\.\.", message)):
        found = line.find(part, position) if part else position
        if found < 0:
            return False
        position = found + len(part)
    return True


def run(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", **(env or {})}
    command = [sys.executable, str(ROOT / "run.py"), *args]
    return preloaded.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def error_line(done: subprocess.CompletedProcess) -> str:
    """The run's one error line; it exited non-zero, with no traceback, and the line starts a line of its own."""
    output = done.stdout + done.stderr
    lines = [line for line in output.splitlines() if line.startswith("offload_core: error: ")]
    assert done.returncode != 0 and len(lines) == 1 and "Traceback" not in output, output[-3000:]
    return lines[0]


def assert_documented(done: subprocess.CompletedProcess, messages: list[str]) -> None:
    line = error_line(done)
    assert any(matches(line, m) for m in messages), f"the docs say one of {messages}\nthe run says {line}"


def command_of(cell: str) -> list[str]:
    """The arguments the first code span of a table cell shows (``-m "prompt=Paris, France"``)."""
    return shlex.split(re.findall(r"`([^`]+)`", cell)[0])


@pytest.mark.parametrize("row", ['-m "prompt=Paris, France"', "-m \"prompt=What's"], ids=["comma", "apostrophe"])
def test_a_swept_prompt_the_table_names_stops_with_its_documented_line(row, tmp_path):
    """A comma and a space in a swept prompt would split it into jobs; an apostrophe Hydra cannot read. Either stops
    the sweep before any job with the line the table gives, saying how to quote it."""
    first, *messages = documented(row)
    done = run([*command_of(first), *SMALL, f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert_documented(done, messages)
    assert "quote" in error_line(done)
    assert not (tmp_path / "sweep" / "0").exists()  # no job ran


def test_a_single_run_takes_its_prompt_as_typed(capsys, monkeypatch):
    """The quickstart: commas and apostrophes in one run's prompt are the prompt (``--cfg job -p prompt``)."""
    text = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    assert "A single run takes its prompt as typed, commas and apostrophes included" in text
    for prompt in ("What's the capital of France, then?", "Paris, Lyon or Nice?"):
        monkeypatch.setattr(sys, "argv", ["run.py", "--cfg", "job", "-p", "prompt", f"prompt={prompt}"])
        hydra_main()
    printed = [line for line in capsys.readouterr().out.splitlines() if line]
    assert printed == ["What's the capital of France, then?", "Paris, Lyon or Nice?"], printed


def test_a_folder_without_its_tokenizer_stops_with_the_documented_line(tmp_path):
    """Weights and config without tokenizer files: the prompt is not read as bytes behind the user's back."""
    from offload_core.testing import tiny_tied_llama

    first, *messages = documented("without its tokenizer")
    tiny_tied_llama(tmp_path / "model")
    done = run(["model=local", f"model.path={tmp_path / 'model'}", "max_new_tokens=2", "progress=false"], tmp_path)
    assert_documented(done, messages)
    assert "holds no tokenizer" in (ROOT / "docs" / "recipes" / "tasks.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> tuple[Path, Path]:
    """(``HF_HOME``, snapshot folder): a Hugging Face cache holding only a tiny Mixtral as ``acme/tiny-mixtral``, only
    read by the runs below (one environment for them all: one interpreter's imports)."""
    from offload_core.testing import tiny_mixtral

    model, home = tmp_path_factory.mktemp("tiny-mixtral"), tmp_path_factory.mktemp("hf-home")
    tiny_mixtral(model)
    return home, hub_snapshot(model, home / "hub", "acme/tiny-mixtral")


def test_a_repo_id_the_cache_lacks_offline_stops_with_the_documented_line(hf_home, tmp_path):
    """The table's own repo id (``org/name``), a Hugging Face cache without it, ``HF_HUB_OFFLINE=1``."""
    first, *messages = documented("Hub repo id")
    repo = re.search(r"model\.path='([^']+)'", messages[0]).group(1)
    assert repo != "acme/tiny-mixtral"
    env = {"HF_HOME": str(hf_home[0]), "HF_HUB_OFFLINE": "1"}
    done = run(["model=local", f"model.path={repo}", "max_new_tokens=2", "progress=false"], tmp_path, env)
    assert_documented(done, messages)


def hub_snapshot(folder: Path, hub: Path, repo: str) -> Path:
    """``folder``'s files laid out as huggingface_hub's downloads leave them in the cache ``hub``: ``blobs/`` named
    by content, ``snapshots/<commit>/<file>`` relative links into them, ``refs/main`` naming the commit."""
    root = hub / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hub_cache_snapshot_runs_by_its_folder_and_by_its_repo_id_offline(hf_home, tmp_path):
    """The table: a checkpoint's own links, as in a Hugging Face cache snapshot, are read (its shard names still may
    not leave the folder); a repo id in the cache runs offline. The same tokens as transformers' in-memory run."""
    assert "as in a Hugging Face cache snapshot, are read" in table_row("shard names leave the checkpoint folder")[1]
    home, snapshot = hf_home
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    for path in (snapshot, "acme/tiny-mixtral"):
        args = ["model=local", f"model.path={path}", "max_new_tokens=2", "max_memory.cpu=1.5MiB", "progress=false"]
        done = run([*args, "compare_in_memory=true", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert "same tokens as in memory: True" in done.stdout.splitlines()


def test_every_bad_size_the_table_names_stops_with_one_of_its_lines(tmp_path, capsys):
    """``max_memory.cpu`` below 0, ``0``, unparsable, in a unit not taken (``10G``): each gives one of the row's
    messages, and every message of the row is given by one of them (the command line run in this process)."""
    first, *messages = documented("a size below 0")
    assert "`10G`" in first
    given = set()
    for size in ("-1", "0", "abc", "10G"):
        code, err = cli([*SMALL, f"max_memory.cpu={size}"], tmp_path, capsys)
        lines = [line for line in err.splitlines() if line.startswith("offload_core: error: ")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        hit = [m for m in messages if matches(lines[0], m)]
        assert hit, f"max_memory.cpu={size}: the docs say one of {messages}\nthe run says {lines[0]}"
        given.update(hit)
    assert given == set(messages)
