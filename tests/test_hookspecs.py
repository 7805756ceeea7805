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
            names.update(
                arg.value for arg in ast.walk(node) if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            )
    return names


#: the hook that registers each kind of strategy
REGISTERS = {
    "placement": "offload_register_placements",
    "storage": "offload_register_storages",
    "policy": "offload_register_module_hook_policies",
}


@pytest.mark.parametrize("kind", sorted(REGISTERS))
def test_each_contract_member_is_documented_where_declared_and_named_by_its_hook(kind):
    # One source: a capability is documented on the contract that declares it (a docstring, or a ``#:`` comment for
    # an attribute); the hook specification names every one of them, and nothing else, so the two cannot drift.
    from offload_core.registry.contracts import CONTRACTS

    contract = CONTRACTS[kind]
    members = sorted(name for name in vars(contract) if not name.startswith("_"))
    source = ROOT / contract.__module__.replace(".", "/")
    text = source.with_suffix(".py").read_text()
    undocumented = [
        name
        for name in members
        if not (getattr(getattr(contract, name), "__doc__", None) and callable(getattr(contract, name)))
        and not re.search(rf"#:.*\n(    #:.*\n)*    {name}\b", text)
    ]
    assert not undocumented, f"{contract.__name__} declares {undocumented} with no docstring or #: comment"
    doc = SPECS[REGISTERS[kind]].function.__doc__
    named = set(re.findall(r"``([a-z_]+)``", doc)) & (set(members) | {m for c in CONTRACTS.values() for m in vars(c)})
    assert named == set(members), (
        f"{REGISTERS[kind]}'s docstring names {sorted(named)}; {contract.__name__} declares {members}"
    )
