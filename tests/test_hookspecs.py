"""Meta-test: every plugin hook specification in offload_core.hookspecs has a docstring that names each of its
arguments, and some test under tests/ names it."""

from __future__ import annotations

import ast
import re

import pluggy
import pytest

from offload_core import hookspecs
from tests import ROOT

MANAGER = pluggy.PluginManager(hookspecs.PROJECT)
MANAGER.add_hookspecs(hookspecs)
SPECS = {name: caller.spec for name, caller in vars(MANAGER.hook).items() if isinstance(caller, pluggy.HookCaller)}


def test_the_specifications_are_found():
    assert "offload_register_placements" in SPECS and all(name.startswith("offload_") for name in SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_argument_is_documented(name):
    spec = SPECS[name]
    doc = spec.function.__doc__ or ""
    assert doc.strip(), f"{name} has no docstring"
    missing = [arg for arg in spec.argnames if not re.search(rf"\b{arg}\b", doc)]
    assert not missing, f"{name}'s docstring does not mention {missing}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_specification_has_a_test(name):
    this = __file__.rsplit("/", 1)[-1]
    uses = [path for path in (ROOT / "tests").rglob("test_*.py") if path.name != this and name in _code_names(path)]
    assert uses, f"no test under tests/ calls or implements {name} (comments and strings do not count)"


def _code_names(path) -> set[str]:
    """The names a file's code uses: called or looked up as attributes, referenced, defined (an implementation), or
    passed to a call (a plugin built from its name); never a comment or a docstring."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Call):  # a plugin built from the name: _plugin("offload_…", …)
            names.update(arg.value for arg in ast.walk(node) if isinstance(arg, ast.Constant) and isinstance(arg.value, str))
    return names
