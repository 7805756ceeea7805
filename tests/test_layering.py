"""The layering, checked by import-linter: each contract in pyproject.toml's [tool.importlinter] must be kept
(`lint-imports` from the repository root runs the same contracts and prints any import that breaks one)."""

from __future__ import annotations

import pytest
from importlinter.api import read_configuration
from importlinter.cli import EXIT_STATUS_SUCCESS, lint_imports

from tests import ROOT

CONFIG = str(ROOT / "pyproject.toml")
CONTRACTS = [contract["id"] for contract in read_configuration(CONFIG)["contracts_options"]]


def test_every_contract_has_an_id():
    assert {
        "layers",
        "storage-planning-below",
        "planning-acyclic",
        "no-accelerate",
        "runner-stages",
        "runner-acyclic",
    } <= set(CONTRACTS)


@pytest.mark.parametrize("contract", CONTRACTS)
def test_contract_is_kept(contract):
    # The broken imports, if any, are in the captured output.
    assert lint_imports(CONFIG, limit_to_contracts=(contract,), no_cache=True, no_logo=True) == EXIT_STATUS_SUCCESS


#: the house rule: no source file over this many lines (split it by idea)
MAX_LINES = 400


def test_no_python_file_is_over_the_line_limit():
    folders = ("offload_core", "plugins", "tests", "bench", "docs", "examples")
    files = [p for folder in folders for p in (ROOT / folder).rglob("*.py")] + [ROOT / "run.py", ROOT / "conftest.py"]
    long = {
        str(p.relative_to(ROOT)): n for p in files if p.exists() and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


#: the house rule: options travel as typed objects, so no public function takes more parameters than this
MAX_PARAMETERS = 8
#: accelerate's own signatures, which the drop-in keeps (their extra options are offload_core's)
ACCELERATE_SIGNATURES = {"load_checkpoint_and_dispatch", "dispatch_model", "infer_auto_device_map"}


def test_no_public_function_takes_more_than_a_few_parameters():
    import ast

    wide = {}
    for path in [*(ROOT / "offload_core").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            args = node.args
            names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
            count = len([n for n in names if n not in ("self", "cls")])
            if count > MAX_PARAMETERS and node.name not in ACCELERATE_SIGNATURES:
                wide[f"{path.relative_to(ROOT)}:{node.name}"] = count
    assert not wide, f"over {MAX_PARAMETERS} parameters (pass a typed object): {wide}"
