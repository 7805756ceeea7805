"""Pages generated at build time (mkdocs-gen-files), so they cannot drift from the code.

- ``reference/configuration.md``: every key of the run schema and of every registered plugin's config
  dataclass (type, default, ``#:`` comment), read through ``offload_core.runner.options``;
- ``benchmarks/results/``: the committed reports and plots of ``bench/results/``, and ``bench/README.md``;
- ``examples/interleaved_placement.md``: the example plugin's README;
- ``index.md``: the repository's README.md, its links made relative to docs/ (one text for both front pages).
"""

from __future__ import annotations

import re
from pathlib import Path

import mkdocs_gen_files

from offload_core.runner.options import MODEL_OPTIONS, choices, run_options

ROOT = Path(__file__).resolve().parents[2]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or " "


def _table(options) -> list[str]:
    rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for o in options:
        rows.append(f"| `{o.key}` | `{_cell(o.type)}` | `{_cell(o.default)}` | {_cell(o.doc.replace('``', '`'))} |")
    return rows


def configuration_page() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated when the site is built from the run schema (`offload_core/runner/config.py`) and the config",
        "dataclass of every registered plugin, so it lists what this installation accepts, third-party plugins",
        "included. `python run.py --help` prints the same groups and keys; `python run.py --cfg job` prints the",
        "composed config of a command line.",
        "",
        "Give a key as `key=value`, a group's option as `group=option` and that option's own keys as",
        "`group.key=value`; a GPU budget is `max_memory.0=10GiB` (see",
        "[Quickstart](../quickstart.md#budgets-on-the-command-line)). A key not in the schema is refused. "
        "Sizes are strings",
        '(`"200MiB"` is 200·2²⁰ bytes, `"2GB"` 2·10⁹) or bytes.',
        "",
        "## Top-level keys",
        "",
        *_table(run_options()),
        "",
    ]
    found = choices()
    groups: dict[str, list] = {}
    for choice in found:
        groups.setdefault(choice.group, []).append(choice)
    lines += ["## Config groups", "", "| group | option | what it is | its keys |", "|---|---|---|---|"]
    for group, members in groups.items():
        for c in members:
            keys = ", ".join(f"`{o.key}`" for o in c.options) if group != "model" else "the `model.*` keys below"
            lines.append(f"| `{group}` | `{c.name}` | {_cell(c.summary)} | {keys or '(none)'} |")
    lines.append("")
    for group, members in groups.items():
        lines += [f"## `{group}=`", ""]
        if group == "model":
            lines += [f"- `model={name}`: {text}" for name, text in MODEL_OPTIONS.items()]
            lines += ["", *_table(members[0].options), ""]
            continue
        for c in members:
            lines += [f"### `{group}={c.name}`", "", f"{c.summary} (plugin `{c.plugin}`).", ""]
            lines += [*_table(c.options), ""] if c.options else ["No options of its own.", ""]
    return "\n".join(lines)


with mkdocs_gen_files.open("reference/configuration.md", "w") as page:
    page.write(configuration_page())
mkdocs_gen_files.set_edit_path("reference/configuration.md", "scripts/gen_pages.py")

for source in sorted((ROOT / "bench" / "results").glob("*")):
    if source.suffix in (".md", ".png", ".log"):
        with mkdocs_gen_files.open(f"benchmarks/results/{source.name}", "wb") as out:
            out.write(source.read_bytes())
with mkdocs_gen_files.open("benchmarks/results/README.md", "w") as out:
    out.write((ROOT / "bench" / "README.md").read_text(encoding="utf-8"))


def home_page(readme: str) -> str:
    """README.md as the site's home page: links into docs/ lose that prefix, links to other repository files
    climb out of docs/ (repo_links.py then points those at the site's copies)."""
    readme = re.sub(r"\]\(docs/", "](", readme)
    return re.sub(r"\]\((?!https?:|#|\.\./)(bench|examples|offload_core|plugins|conf|tests)/", r"](../\1/", readme)


with mkdocs_gen_files.open("index.md", "w") as out:
    out.write(home_page((ROOT / "README.md").read_text(encoding="utf-8")))
mkdocs_gen_files.set_edit_path("index.md", "../README.md")

example = (ROOT / "examples" / "interleaved_placement" / "README.md").read_text(encoding="utf-8")
with mkdocs_gen_files.open("examples/interleaved_placement.md", "w") as out:
    out.write(example.replace("](../../README.md)", "](../index.md)"))


# -- every error line offload_core can end a run with, harvested from the code ---------------------------

import ast  # noqa: E402

USER_ERRORS = {"OffloadError", "ConfigError", "DeviceMapError", "CheckpointError", "StorageError", "PluginError"}


def _message(node: ast.AST) -> str | None:
    """The text of an error's message: an f-string's placeholders become `…`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _message(node.left), _message(node.right)
        return None if left is None or right is None else left + right
    return None


def error_lines() -> list[tuple[str, str, str]]:
    """(module, error class, message) for every ``raise <OffloadError subclass>("…")`` in the package."""
    found = []
    for path in sorted((ROOT / "offload_core").rglob("*.py")) + sorted((ROOT / "plugins").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
            if name in USER_ERRORS and node.exc.args:
                text = _message(node.exc.args[0])
                if text:
                    found.append((str(path.relative_to(ROOT)), name, " ".join(text.split())))
    return found


def errors_page() -> str:
    lines = [
        "# Every error message",
        "",
        "Generated from the code when the site is built: every `raise` of an `OffloadError` (a run prints it as",
        "`offload_core: error: <message>` and exits with code 2), with `…` where the message names your values.",
        "[Troubleshooting](../troubleshooting.md) says what to do about the common ones.",
        "",
    ]
    module = None
    for path, kind, text in error_lines():
        if path != module:
            lines += ["", f"## `{path}`", "", "| error | message |", "|---|---|"]
            module = path
        message = _cell(text).replace("<", "&lt;").replace("*", "\\*")
        lines.append(f"| `{kind}` | {message} |")
    return "\n".join(lines) + "\n"


with mkdocs_gen_files.open("reference/errors.md", "w") as page:
    page.write(errors_page())
