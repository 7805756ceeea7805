"""The speculative options: read and checked in one line each, the config group, the adaptive rule, the estimate."""

from __future__ import annotations

import math

import pytest
from hydra import compose, initialize_config_dir

from offload_core.errors import ConfigError
from offload_core.runner.config import register_configs
from offload_core.runner.settings import run_speculative
from offload_core.speculative import read_speculative
from offload_core.speculative.config import expected_tokens_per_pass
from offload_core.speculative.counting import next_lookup_tokens

from tests import ROOT


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_config_group_defaults_to_none_and_names_each_mode():
    assert run_speculative(_cfg([])).name == "none"
    lookup = run_speculative(_cfg(["speculative=prompt_lookup", "speculative.tokens=7"]))
    assert (lookup.name, lookup.tokens, lookup.active) == ("prompt_lookup", 7, True)
    assert run_speculative(_cfg(["speculative=self", "speculative.layers=3"])).layers == 3
    assert run_speculative(_cfg(["speculative=draft", "speculative.path=/x"])).path == "/x"


@pytest.mark.parametrize(
    "value, message",
    [
        ("beam", "speculative='beam' is unknown"),
        ({"name": "prompt_lookup", "tokens": 0}, "speculative.tokens=0 drafts nothing"),
        ({"name": "draft"}, "speculative=draft needs speculative.path"),
        ({"name": "self", "layer": 2}, "unknown key(s) layer"),
        ({"name": "self", "expected_acceptance": 1.0}, "must be in [0, 1)"),
    ],
)
def test_unusable_values_are_one_line(value, message):
    with pytest.raises(ConfigError) as caught:
        read_speculative(value)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_draft_without_a_path_is_refused_through_the_config():
    with pytest.raises(ConfigError, match="needs speculative.path"):
        run_speculative(_cfg(["speculative=draft"]))


def test_lookup_tokens_grow_when_all_are_accepted_and_shrink_when_not():
    assert next_lookup_tokens(4, drafted=4, matched=4, most=10) == 6
    assert next_lookup_tokens(9, drafted=9, matched=9, most=10) == 10
    assert next_lookup_tokens(4, drafted=4, matched=1, most=10) == 3
    assert next_lookup_tokens(1, drafted=1, matched=0, most=10) == 1


def test_expected_tokens_per_pass_is_the_geometric_sum():
    assert expected_tokens_per_pass(read_speculative("none")) == 1.0
    spec = read_speculative({"name": "prompt_lookup", "tokens": 3, "expected_acceptance": 0.5})
    assert math.isclose(expected_tokens_per_pass(spec), 1 + 0.5 + 0.25 + 0.125)
