"""``python -m offload_core`` (or ``offload-core``): ``run [key=value ...]`` runs the main job as ``python run.py``
does, ``serve [key=value ...]`` as ``python run.py mode=serve``; ``plugins`` lists loaded plugins, their versions and
the strategies each provides (by the names the command line takes)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: ``--help``'s description: the docstring as the terminal shows it (no reST markup)
DESCRIPTION = " ".join(__doc__.replace("``", "").split())


def list_plugins() -> str:
    from offload_core.registry.manager import DISABLE_ENV, KINDS, disable_hint, get_registry
    from offload_core.runner.config import GROUPS  # the command line's name for each kind (policy: hook=)

    registry = get_registry()
    provided: dict[str, list[str]] = {name: [] for name in registry.plugins}
    for kind in KINDS:
        for name in registry.names(kind):
            strategy = registry.get(kind, name)
            provided.setdefault(strategy.plugin, []).append(f"{GROUPS.get(kind, kind)}={name}")
    lines = []
    width = max((len(p) for p in provided), default=10)
    for plugin, strategies in provided.items():
        if not strategies and plugin in registry.failed:
            continue  # its FAILED line says why it provides nothing
        version = registry.plugins.get(plugin, "?")
        lines.append(f"{plugin:<{width}}  {version:<10}  {', '.join(strategies) or '(no strategies)'}")
    for plugin, why in registry.failed.items():
        lines.append(f"{plugin:<{width}}  FAILED      {why}; {disable_hint(plugin)}")
    lines.append(f"(disable plugins by name with {DISABLE_ENV}=name1,name2)")
    return "\n".join(lines)


def program() -> str:
    """How this command was started: ``offload-core`` (the installed script) or ``python -m offload_core``."""
    return "offload-core" if Path(sys.argv[0]).name == "offload-core" else "python -m offload_core"


def run(overrides: list[str]) -> int:
    """The main job with ``overrides`` (Hydra's command line: ``key=value``, ``-m`` for a sweep)."""
    from offload_core.runner.cli import hydra_main

    command = f"{program()} run"
    saved = sys.argv
    sys.argv = ["offload-core", *overrides]
    try:
        hydra_main(command)
    finally:
        sys.argv = saved
    return 0


def main(argv: list[str] | None = None) -> int:
    from offload_core.errors import OffloadError

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        return run(argv[1:])
    if argv[:1] == ["serve"]:
        return run(["mode=serve", *argv[1:]])
    parser = argparse.ArgumentParser(prog=program(), description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run the main job: run [key=value ...] (as python run.py; run --help lists the keys)")
    sub.add_parser("serve", help="serve the model over HTTP (OpenAI's API): serve [key=value ...], as run mode=serve")
    sub.add_parser("plugins", help="list loaded plugins and the strategies they provide")
    args = parser.parse_args(argv)
    try:
        if args.command == "plugins":
            print(list_plugins())
    except OffloadError as error:
        print(f"offload_core: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
