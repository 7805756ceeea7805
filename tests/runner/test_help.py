"""`python run.py --help` lists every config group with a line on each option and every key, read from the
schema and the registered plugins (offload_core/runner/options.py), and says where to read more."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from offload_core.registry.manager import get_registry
from offload_core.runner.options import choices, field_comments, help_text, run_options
from offload_core.runner.config import GROUPS, RunConfig
from tests import ROOT, preloaded


def test_field_comments_are_read_from_the_lines_above_each_field():
    comments = field_comments(RunConfig)
    assert comments["page_cache"].startswith("offloaded blocks kept in the page cache across tokens")
    assert "placement" not in comments  # no comment, no entry


def test_every_registered_option_and_key_is_listed_with_a_description():
    registry = get_registry()
    text = help_text(registry)
    listed = {(c.group, c.name) for c in choices(registry)}
    for kind, group in GROUPS.items():
        for name in registry.names(kind):
            assert (group, name) in listed
            line = next(line for line in text.splitlines() if line.strip().startswith(name + " "))
            assert len(line.split(name, 1)[1].strip()) > 10, line
            for field in dataclasses.fields(registry.get(kind, name).config):
                if field.name != "name":
                    assert field.name in line, (name, field.name)
    keys = {o.key for o in run_options()}
    assert {"prompt", "max_memory", "page_cache", "batch_size"} <= keys
    undocumented = [o.key for o in run_options() if not o.doc]
    assert not undocumented, f"write a `#:` comment above RunConfig's {undocumented} in offload_core/runner/config.py"


@pytest.mark.slow
def test_run_py_help_prints_the_groups_and_where_to_read_more():
    done = preloaded.run([sys.executable, "run.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for heading in ("placement=", "storage=", "hook=", "model=", "other keys"):
        assert heading in done.stdout
    assert "block-granular offload with look-ahead" in done.stdout  # prefetch's line, from its plugin's docstring
    assert "max_memory.0=10GiB" in done.stdout and "Read more" in done.stdout


def test_a_config_group_added_later_is_listed_too(tmp_path, monkeypatch):
    """A group stored as a dataclass in Hydra's ConfigStore, or as conf/<group>/*.yaml, needs no change here."""
    from hydra.core.config_store import ConfigStore

    import offload_core.runner.config as run_config

    @dataclasses.dataclass
    class DraftConfig:
        """Draft tokens with a small model. More text."""

        #: tokens drafted per step
        lookahead: int = 4

    (tmp_path / "colour").mkdir()
    (tmp_path / "colour" / "blue.yaml").write_text("# the blue one\nname: blue\nshade: 3\n")
    monkeypatch.setattr(run_config, "CONF_DIR", str(tmp_path))
    store = ConfigStore.instance()
    store.store(group="zz_draft", name="small", node=DraftConfig)
    try:
        text = help_text()
    finally:
        store.repo.pop("zz_draft")
    assert "zz_draft=" in text and "small  Draft tokens with a small model [zz_draft.{lookahead}]" in text
    assert "colour=" in text and "blue  the blue one [colour.{shade}]" in text


def test_each_speculative_option_has_its_own_line_and_its_own_keys():
    text = help_text()
    section = text.split("speculative=\n")[1].split("\n\n")[0].splitlines()
    lines = {line.split()[0]: line for line in section}
    assert set(lines) == {"none", "prompt_lookup", "draft", "self"}
    assert len({line.split(None, 1)[1].split(" [")[0] for line in section}) == 4
    assert "[" not in lines["none"] and "ngram" in lines["prompt_lookup"] and "ngram" not in lines["self"]
    assert "path" in lines["draft"] and "layers" in lines["self"] and "layers" not in lines["draft"]


def test_other_keys_are_the_non_group_keys_written_as_typed():
    keys = [o.key for o in run_options()]
    assert "speculative" not in keys and "pipeline" not in keys and "pipeline.num_inference_steps" in keys
    assert "serve" not in keys and "serve.port" in keys and "serve.max_batch" in keys
    text = help_text()
    assert "max_memory={cpu: 200MiB}" in text and "``" not in text and "Config(" not in text
    assert (
        "  (each takes model.{path, revision, preset, chat_template, no_split_module_classes, task, tokenizer})" in text
    )
