"""A policy whose members the plan calls are missing or wrong (``reserve``, ``predict_moved``) is refused when it
registers, in one line naming the member, rather than planned with the contract's defaults."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest

from offload_core.errors import PluginError
from offload_core.hookspecs import hookimpl
from offload_core.registry.contracts import Policy
from offload_core.registry.manager import build_registry


def _register(policy_class: type):
    @dataclass
    class Config:
        name: str = "mine"

    module = types.ModuleType("policy_members_plugin")
    module.offload_register_module_hook_policies = hookimpl(lambda register: register("mine", policy_class, Config))
    return build_registry(extra_plugins=[module], load_entry_points=False)


def _refusal(policy_class: type) -> str:
    with pytest.raises(PluginError) as info:
        _register(policy_class)
    message = str(info.value)
    assert "\n" not in message and message.startswith("policy 'mine': ")
    return message


class _Bare:  # written without the contract's base class, as a plugin may be
    def __init__(self, config):
        self.config = config

    def attach(self, model, context):
        raise NotImplementedError


def test_a_misspelt_reserve_is_refused_naming_the_member_the_plan_calls():
    class Misspelt(_Bare):
        def reserves(self, need):
            return {"cpu": 0}

    assert "defines reserves() but not reserve(), which the plan calls" in _refusal(Misspelt)


def test_a_reserve_that_forgets_its_argument_is_refused():
    class NoNeed(Policy):
        def attach(self, model, context):
            raise NotImplementedError

        def reserve(self):
            return {}

    assert "NoNeed.reserve(self) cannot be called as the plan calls reserve(self, need)" in _refusal(NoNeed)


def test_a_predict_moved_that_is_not_a_method_is_refused():
    class Figure(_Bare):
        predict_moved = 0

    assert "Figure.predict_moved = 0 is not a method predict_moved(self, unit_bytes)" in _refusal(Figure)


def test_members_left_out_or_sound_register_with_the_contracts_defaults():
    class Sound(_Bare):
        def reserve(self, need, *more):
            return {"cpu": 0}

        @staticmethod
        def predict_moved(unit_bytes):
            return 0

    policy = _register(Sound).create("policy", "mine")
    assert isinstance(policy, Policy) and policy.predict_moved([3]) == 0 and policy.lighter() is None
