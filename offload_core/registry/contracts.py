"""The three strategy contracts a plugin implements, in one place: Placement, Storage and Policy, each optional
capability declared once with its default. Each is defined beside the layer it serves (planning, storage,
module hooks), so those layers never import the registry; plugins import them from here."""

from __future__ import annotations

import difflib
import inspect
from types import FunctionType

from offload_core.module_hooks.policy import Policy
from offload_core.planning.request import Placement
from offload_core.storage.base import Storage
from offload_core.strategy import StrategyBase

CONTRACTS: dict[str, type[StrategyBase]] = {"placement": Placement, "storage": Storage, "policy": Policy}


def member_fault(contract: type, factory: type) -> str | None:
    """What is wrong with the members ``factory`` defines in place of the contract's methods (``reserve``,
    ``predict_moved``, ...): one that is not a method, one that cannot be called as the plan calls the contract's
    (its positional parameters), or a method named like one of the contract's that it does not define (a misspelt
    ``reserve`` would leave the plan the default); None when every one is sound. A member left out takes the
    contract's default."""
    methods = [m for m in dir(contract) if not m.startswith("_") and callable(inspect.getattr_static(contract, m))]
    for own in sorted(vars(factory)):
        if own.startswith("_") or own in methods or not callable(vars(factory)[own]):
            continue
        near = [m for m in difflib.get_close_matches(own, methods, n=1, cutoff=0.85) if m not in vars(factory)]
        if near:
            return f"{factory.__name__} defines {own}() but not {near[0]}(), which the plan calls: rename it"
    for member in sorted(dir(contract)):
        declared = inspect.getattr_static(contract, member)
        if member.startswith("_") or not isinstance(declared, FunctionType):
            continue  # private, or not an instance method (flags, class methods)
        given = inspect.getattr_static(factory, member, declared)
        if given is declared:
            continue
        expected = list(inspect.signature(declared).parameters)[1:]
        shown = f"{member}(self{''.join(', ' + p for p in expected)})"
        function = given.__func__ if isinstance(given, (classmethod, staticmethod)) else given
        if not callable(function):
            return f"{factory.__name__}.{member} = {given!r} is not a method {shown}"
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            continue  # a builtin or C callable: nothing to check it by
        bound = 0 if isinstance(given, staticmethod) else 1
        try:
            signature.bind(*([None] * (bound + len(expected))))
        except TypeError:
            return (
                f"{factory.__name__}.{member}{signature} cannot be called as the plan calls {shown} "
                "(leave it out for the contract's default)"
            )
    return None


__all__ = ["CONTRACTS", "Placement", "Policy", "Storage", "StrategyBase", "member_fault"]
