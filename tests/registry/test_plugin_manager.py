"""Plugin manager: built-ins registered like third parties, duplicates and unknown names fail loudly, entry points
load."""

from __future__ import annotations

import subprocess
import sys
import types
from dataclasses import dataclass

import pytest

from offload_core.errors import PluginError
from offload_core.hookspecs import hookimpl
from offload_core.registry.manager import BUILTIN_PLUGINS, DISABLE_ENV, build_registry
from tests.plugins_dist import install_distribution, placement_plugin


def _plugin(kind_hook: str, strategy_name: str, module_name: str = "fake_plugin"):
    @dataclass
    class Config:
        name: str = strategy_name

    class Strategy:  # written without a contract's base class, as a plugin may be
        def __init__(self, config):
            self.config = config

        def make_device_map(self, request):
            return {"": "cpu"}

        def open(self, context):
            raise NotImplementedError

        def attach(self, model, context):
            raise NotImplementedError

    module = types.ModuleType(module_name)

    def register_hook(register):
        register(strategy_name, Strategy, Config)

    register_hook.__name__ = kind_hook
    setattr(module, kind_hook, hookimpl(register_hook))
    return module


def test_builtins_provide_every_strategy():
    registry = build_registry(load_entry_points=False)
    assert registry.names("placement") == ["balanced", "balanced_low_0", "sequential"]
    assert registry.names("storage") == ["gguf", "memmap", "pinned_cpu", "safetensors"]
    assert registry.names("policy") == ["align_per_call", "chained", "experts", "functional_call", "prefetch"]
    assert set(registry.plugins) == set(BUILTIN_PLUGINS)
    assert registry.get("storage", "memmap").plugin == "offload_core_plugins.storage_memmap"


def test_a_factory_without_the_base_class_gets_the_contract_defaults():
    from offload_core.registry.contracts import Policy, Storage

    registry = build_registry(
        extra_plugins=[
            _plugin("offload_register_storages", "bare_store", "bare_store_plugin"),
            _plugin("offload_register_module_hook_policies", "bare_policy", "bare_policy_plugin"),
        ],
        load_entry_points=False,
    )
    storage = registry.create("storage", "bare_store")
    assert isinstance(storage, Storage) and (storage.converts_on_read, storage.pinned) == (False, False)
    policy = registry.create("policy", "bare_policy")
    assert isinstance(policy, Policy) and policy.granularity == "block" and policy.predict_moved([1, 2]) == 3
    assert registry.get("policy", "bare_policy").factory.__name__ == "Strategy"


def test_a_factory_lacking_the_required_method_is_one_line_naming_it():
    @dataclass
    class Config:
        name: str = "no_open"

    class NoOpen:
        def __init__(self, config):
            self.config = config

    module = types.ModuleType("no_open_plugin")
    module.offload_register_storages = hookimpl(lambda register: register("no_open", NoOpen, Config))
    with pytest.raises(
        PluginError,
        match=r"^storage 'no_open': NoOpen lacks open\(\); subclass offload_core.registry.contracts.Storage",
    ) as info:
        build_registry(extra_plugins=[module], load_entry_points=False)
    assert "\n" not in str(info.value)


def test_duplicate_name_names_both_plugins():
    twin = _plugin("offload_register_storages", "memmap", "my_twin")
    with pytest.raises(
        PluginError, match=r"registered twice: by plugin 'offload_core_plugins.storage_memmap' and by plugin 'my_twin'"
    ):
        build_registry(extra_plugins=[twin], load_entry_points=False)


def test_unknown_name_lists_the_available_ones():
    registry = build_registry(load_entry_points=False)
    with pytest.raises(
        PluginError, match=r"unknown placement 'balansed': available are balanced, balanced_low_0, sequential"
    ):
        registry.get("placement", "balansed")


def test_misspelled_plugin_hook_fails_check_pending():
    module = types.ModuleType("typo_plugin")

    def offload_register_storage(register):  # missing the final "s"
        pass

    module.offload_register_storage = hookimpl(offload_register_storage)
    with pytest.raises(Exception, match="unknown hook"):
        build_registry(extra_plugins=[module], load_entry_points=False)


def test_config_without_name_field_is_rejected():
    @dataclass
    class Bad:
        depth: int = 1

    module = types.ModuleType("bad_plugin")

    def offload_register_placements(register):
        register("bad", object, Bad)

    module.offload_register_placements = hookimpl(offload_register_placements)
    with pytest.raises(PluginError, match="needs a field `name: str = 'bad'`"):
        build_registry(extra_plugins=[module], load_entry_points=False)


def test_build_with_unknown_option_is_rejected():
    registry = build_registry(load_entry_points=False)
    with pytest.raises(PluginError, match="has no option"):
        registry.create("policy", "align_per_call", {"name": "align_per_call", "granularty": "block"})


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A real distribution with an ``offload_core`` entry point, importable from a folder on sys.path."""
    site = tmp_path / "site"
    files = {"demo_offload_plugin/__init__.py": placement_plugin()}
    install_distribution(site, "demo-offload-plugin", "1.2.3", {"demo": "demo_offload_plugin"}, files)
    install_distribution(site, "broken-offload-plugin", "0.1", {"broken": "no_such_module_xyz"})
    monkeypatch.syspath_prepend(str(site))
    return site


def test_entry_point_plugin_is_loaded_with_its_version(installed_plugin):
    registry = build_registry()
    assert registry.get("placement", "every_other").plugin == "demo"
    assert registry.plugins["demo"] == "1.2.3"
    assert "broken" in registry.failed and "no_such_module_xyz" in registry.failed["broken"]
    with pytest.raises(PluginError, match="plugin 'broken' failed to load"):
        registry.get("placement", "nope")


def test_disabling_a_plugin_by_name(installed_plugin, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "demo,broken")
    registry = build_registry()
    assert "every_other" not in registry.names("placement")
    assert "demo" not in registry.plugins and "broken" not in registry.failed


@pytest.mark.slow  # a fresh interpreter
def test_plugins_command_lists_versions_and_strategies(installed_plugin):
    out = subprocess.run(
        [sys.executable, "-m", "offload_core", "plugins"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(installed_plugin)},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "demo" in out.stdout and "1.2.3" in out.stdout and "placement=every_other" in out.stdout
    assert "offload_core_plugins.storage_memmap" in out.stdout and "storage=memmap" in out.stdout


@pytest.mark.parametrize(
    "spec,group",
    [
        ("offload_register_placements", "placement"),
        ("offload_register_storages", "storage"),
        ("offload_register_module_hook_policies", "policy"),
    ],
)
def test_each_plugin_hook_registers_into_its_group(spec, group):
    registry = build_registry(extra_plugins=[_plugin(spec, "third_party")], load_entry_points=False)
    assert "third_party" in registry.names(group)
    assert registry.get(group, "third_party").plugin == "fake_plugin"


#: a module of three plugins that break their contract: a placement without ``make_device_map``, a plugin hook the
#: specs lack, a plugin hook that raises
FAULTY_PLUGINS = """
from dataclasses import dataclass
from offload_core.hookspecs import hookimpl

@dataclass
class LackingConfig:
    name: str = "lacking"

class Lacking:
    def __init__(self, config):
        self.config = config

class lacking:
    @hookimpl
    def offload_register_placements(register):
        register("lacking", Lacking, LackingConfig)

class typo:
    @hookimpl
    def offload_register_storage(register):
        pass

class raising:
    @hookimpl
    def offload_register_module_hook_policies(register):
        raise RuntimeError("no GPU library here")
"""


@pytest.fixture
def faulty_plugins(tmp_path, monkeypatch):
    """Installed distributions whose plugins break their contract: a placement without ``make_device_map``, a plugin
    hook the specs lack, a plugin hook that raises."""
    site = tmp_path / "site"
    files = {"faulty_offload_plugins.py": FAULTY_PLUGINS}
    entry_points = {name: f"faulty_offload_plugins:{name}" for name in ("lacking", "typo", "raising")}
    install_distribution(site, "faulty-offload-plugins", "0.2", entry_points, files)
    monkeypatch.syspath_prepend(str(site))
    return site


def test_a_third_party_plugin_that_breaks_its_contract_is_recorded_not_fatal(faulty_plugins):
    registry = build_registry()
    assert registry.names("placement") == ["balanced", "balanced_low_0", "sequential"]  # the rest still load
    assert registry.failed["lacking"].startswith("placement 'lacking': Lacking lacks make_device_map()")
    assert "unknown hook 'offload_register_storage'" in registry.failed["typo"] and "typo" not in registry.plugins
    assert registry.failed["raising"] == (
        "its offload_register_module_hook_policies raised RuntimeError: no GPU library here"
    )
    with pytest.raises(PluginError) as caught:
        registry.get("placement", "lacking")
    assert str(caught.value) == (
        "unknown placement 'lacking': available are balanced, balanced_low_0, sequential; plugin 'lacking' failed to "
        "load (placement 'lacking': Lacking lacks make_device_map(); subclass offload_core.registry.contracts."
        "Placement and define it), so its placement 'lacking' is missing: fix, update or uninstall it, or skip it "
        f"with {DISABLE_ENV}=lacking"
    )
    with pytest.raises(
        PluginError, match=f"plugin 'typo' failed to load .* so what it provides is missing: .*{DISABLE_ENV}=typo"
    ):
        registry.get("storage", "nope")


def test_the_same_faults_in_a_plugin_given_directly_still_raise(faulty_plugins):
    import faulty_offload_plugins

    with pytest.raises(PluginError, match="Lacking lacks make_device_map"):
        build_registry(extra_plugins=[faulty_offload_plugins.lacking], load_entry_points=False)
