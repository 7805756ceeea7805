"""Every option of every config group composes; wrong names, keys and types fail at compose time with Hydra's
message."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException

from offload_core.runner.config import register_configs

from tests import ROOT

CONF = str(ROOT / "conf")


def _options() -> list[tuple[str, str]]:
    """(group, option) for every entry of every group in the ConfigStore and conf/, recursively."""
    register_configs()
    found = []

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}/{key}" if prefix else key)
            elif prefix:
                found.append((prefix, key.removesuffix(".yaml")))

    walk(ConfigStore.instance().repo, "")
    for path in Path(CONF).rglob("*.yaml"):
        rel = path.relative_to(CONF)
        if len(rel.parts) > 1:
            found.append(("/".join(rel.parts[:-1]), rel.stem))
    return sorted(set(found))


OPTIONS = _options()


def _compose(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_every_group_has_its_builtin_options():
    groups: dict[str, set[str]] = {}
    for group, option in OPTIONS:
        groups.setdefault(group, set()).add(option)
    assert groups["placement"] >= {"sequential", "balanced", "balanced_low_0"}
    assert groups["storage"] >= {"pinned_cpu", "memmap", "safetensors"}
    assert groups["hook"] >= {"align_per_call", "chained", "functional_call", "prefetch"}
    assert groups["model"] >= {"smollm2", "synthetic", "local"}


@pytest.mark.parametrize("group,option", [o for o in OPTIONS if not o[0].startswith("hydra")])
def test_every_option_composes(group, option):
    cfg = _compose([f"{group}={option}"])
    node = cfg
    for part in group.split("/"):
        node = node[part]
    assert node["name"] == option


def test_defaults_are_the_main_job():
    cfg = _compose([])
    assert (cfg.placement.name, cfg.storage.name, cfg.hook.name, cfg.model.name) == (
        "sequential",
        "safetensors",
        "align_per_call",
        "smollm2",
    )
    assert cfg.prompt == "What is the capital of France?"


@pytest.mark.parametrize(
    "override,error,message",
    [
        ("placement=balansed", ConfigCompositionException, "Could not find 'placement/balansed'"),
        ("storage=ssd", ConfigCompositionException, "Could not find 'storage/ssd'"),
        ("hook.granularty=block", ConfigCompositionException, "granularty"),
        ("max_new_tokens=abc", ConfigCompositionException, "max_new_tokens"),
        ("hook=prefetch hook.depth=two", ConfigCompositionException, "depth"),
        ("promt=hi", ConfigCompositionException, "promt"),
    ],
)
def test_mistakes_fail_at_compose_time(override, error, message):
    with pytest.raises(error, match=message):
        _compose(override.split())
