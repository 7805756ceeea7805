"""The command line as a user types it, made into overrides Hydra reads as meant: a key the run does not know is one
line (naming the key to use instead), a prompt with a comma or an apostrophe is quoted for Hydra, and a budget for
any device (``max_memory.0=10GiB``) is added or changed alike."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from offload_core.errors import ConfigError
from offload_core.runner.config import RunConfig

#: what users type by mistake -> the key that does it
INSTEAD = {
    "policy": "hook",
    "module_hook": "hook",
    "hooks": "hook",
    "store": "storage",
    "placements": "placement",
    "max_new": "max_new_tokens",
    "budget": "max_memory",
    "device": "execution_device",
}
#: keys whose value is free text: a single run reads a comma in one as the text's own, a sweep refuses it unquoted
TEXT_KEYS = ("prompt", "pipeline.negative_prompt")
#: Hydra's sweep functions (``prompt=choice(a,b)`` names its values explicitly)
SWEEP_FUNCTIONS = re.compile(r"(choice|range|interval|glob|shuffle|sort|tag)\(")
#: the devices conf/config.yaml declares under max_memory (another device's budget is added with Hydra's ``++``)
DECLARED_BUDGETS = ("cpu", "disk")
#: Hydra's own options that take the next argument as their value
HYDRA_OPTIONS_WITH_VALUE = {
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--info",
    "--experimental-rerun",
}


def run_keys() -> list[str]:
    """The top-level keys of a run's config (:class:`offload_core.runner.config.RunConfig`'s fields)."""
    return [f.name for f in fields(RunConfig)]


def unknown_key(key: str, given: str, value: str = "...") -> ConfigError:
    """The one line for a key the run does not know."""
    top = key.split(".")[0]
    if top in INSTEAD:
        hint = f"use {INSTEAD[top]}{key[len(top) :]}={value} instead" + (
            " (python -m offload_core plugins lists the names)"
            if INSTEAD[top] in ("hook", "storage", "placement")
            else ""
        )
    else:
        hint = f"the run's keys are {', '.join(run_keys())}"
    return ConfigError(f"unknown key {top!r} in {given!r}: {hint}")


def check_keys(cfg: Any) -> None:
    """Every top-level key of a composed config is one the run reads (``+foo=bar`` is refused, never ignored)."""
    known = set(run_keys())
    for key in cfg.keys():
        if key not in known:
            raise unknown_key(str(key), f"+{key}=...")


def quote(value: str) -> str:
    """``value`` as one of Hydra's single-quoted strings, read back exactly (commas, quotes, ``${`` and all)."""
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)  # backslashes before a quote are doubled
    escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped)  # and before the closing quote
    return "'" + escaped.replace("${", "\\${") + "'"


def typed(key: str, value: str) -> str:
    """``key=value`` as typed in bash so that Hydra reads ``value`` as one quoted string (double quotes for Hydra
    inside the shell's single quotes where the value allows: ``'prompt="Paris, France"'``)."""
    hydra = f'{key}="{value}"' if not re.search(r'["\\]|\$\{', value) else f"{key}={quote(value)}"
    return f"'{hydra}'" if "'" not in hydra else '"' + re.sub(r'([\\"$`])', r"\\\1", hydra) + '"'


def check_sweep_text(arg: str, key: str, value: str) -> None:
    """In a sweep, a text value holding a comma followed by a space (``prompt=Paris, France``) is a sentence as
    often as a list of values: it is one line saying how to write either, never split silently. ``a,b`` (no space),
    a quoted value (``"Paris, France"`` or ``"a","b"``) and ``choice(...)`` sweep as Hydra reads them."""
    if value[:1] in ("'", '"') or SWEEP_FUNCTIONS.match(value) or not re.search(r",\s", value):
        return
    parts = [part.strip() for part in value.split(",")]
    jobs = ", ".join(f"{key}={part}" for part in parts)
    raise ConfigError(
        f"{arg!r} in a sweep (-m) is split at its commas into {len(parts)} jobs ({jobs}): to run the one text, quote "
        f"it for Hydra inside the shell's quotes, e.g. {typed(key, value)}; to sweep several texts, quote each "
        f'({key}="one, two","three") or leave no space after the commas ({key}=one,two)'
    )


def prepare(args: list[str]) -> list[str]:
    """``args`` (``sys.argv[1:]``) as Hydra should read them, or a :class:`ConfigError` for a key the run lacks.

    In a single run a text (``prompt=...``, :data:`TEXT_KEYS`) is taken as typed (quoted for Hydra unless the user
    quoted it); in a multirun a comma sweeps, so a text holding one followed by a space must be quoted by the user,
    as the error says (:func:`check_sweep_text`). ``max_memory.<device>=`` adds the device's budget or changes it
    (Hydra's ``++``).
    """
    multirun = any(a in ("-m", "--multirun") for a in args)
    out: list[str] = []
    takes_value = False
    for arg in args:
        if takes_value or arg.startswith("-") or "=" not in arg:
            takes_value = arg in HYDRA_OPTIONS_WITH_VALUE
            out.append(arg)
            continue
        prefix = re.match(r"\+\+|\+|~", arg)
        prefix_s = prefix.group(0) if prefix else ""
        key, _, value = arg[len(prefix_s) :].partition("=")
        top = re.split(r"[./@]", key)[0]  # hydra.run.dir, hydra/launcher=..., model@pkg
        if top == "hydra":
            out.append(arg)
            continue
        if top not in run_keys():
            raise unknown_key(key, arg, value)
        if key in TEXT_KEYS and multirun:
            check_sweep_text(arg, key, value)
        elif key in TEXT_KEYS and value[:1] not in ("'", '"'):
            arg = f"{prefix_s}{key}={quote(value)}"
        elif (
            top == "max_memory" and key.count(".") == 1 and key.split(".")[1] not in DECLARED_BUDGETS and prefix_s == ""
        ):
            arg = "++" + arg
        out.append(arg)
    return out


def check_parses(args: list[str]) -> None:
    """A prompt Hydra's grammar cannot read (in a multirun, where it is not quoted for the user) is one line saying
    how to quote it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            parser.parse_overrides([arg])
        except HydraException:
            key, _, value = arg.partition("=")
            hydra = f"{key}={quote(value)}" if "'" not in value else f'{key}="{value}"'.replace("${", "\\${")
            typed = '"' + re.sub(r'([\\"$`])', r"\\\1", hydra) + '"'  # as bash reads it inside double quotes
            raise ConfigError(
                f"{arg!r} is not a value Hydra can read: quote the value for Hydra, and the whole for the "
                f"shell, e.g. {typed} (in a multirun a comma outside quotes sweeps)"
            ) from None


def check_composes(args: list[str], config_dir: str) -> None:
    """A single run's overrides compose (composed once here, as Hydra will): a key an option's schema lacks
    (``hook=prefetch hook.depht=3``) or a value of the wrong type is one line naming it, not Hydra's advice to add
    a ``+`` (a sweep's jobs are composed by Hydra one by one and fail one by one)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    if any(a in ("-m", "--multirun") or a in HYDRA_OPTIONS_WITH_VALUE for a in args):
        return
    overrides = [a for a in args if not a.startswith("-") and "=" in a and not re.match(r"[+~]*hydra[./]", a)]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        try:
            compose(config_name="config", overrides=overrides)
        except HydraException as error:
            raise ConfigError(composition_error(error)) from None


def composition_error(error: BaseException) -> str:
    """Hydra's composition error (and its causes) as one line."""
    lines = [line.strip() for e in (error, error.__cause__) if e is not None for line in str(e).splitlines()]
    missing = next(
        (
            re.match(r"Key '([^']+)' not in '([^']+)'", line)
            for line in lines
            if line.startswith("Key '") and " not in " in line
        ),
        None,
    )
    target = next(
        (re.match(r"Could not override '([^']+)'", line) for line in lines if line.startswith("Could not override")),
        None,
    )
    if missing and target:
        group = target.group(1).rsplit(".", 1)[0]
        return (
            f"unknown key {missing.group(1)!r} in {target.group(1)}: {group} ({missing.group(2)}) has no such key; "
            f"python run.py --help lists each option's keys"
        )
    absent = next(
        (
            re.match(r"In '[^']+': Could not find '([^'/]+)/([^']+)'", line)
            for line in lines
            if "Could not find '" in line
        ),
        None,
    )
    if absent:
        group, option = absent.groups()
        start = (
            lines.index(f"Available options in '{group}':") + 1 if f"Available options in '{group}':" in lines else 0
        )
        options = [line for line in lines[start:] if start and re.fullmatch(r"[\w.-]+", line)]
        listed = f"use one of {', '.join(options)}" if options else "python -m offload_core plugins lists the options"
        return f"{group}={option} is not an option of {group}: {listed}{_plugin_note(group, option)}"
    merging = next(
        (re.match(r"Error merging override (.+)", line) for line in lines if line.startswith("Error merging override")),
        None,
    )
    if merging:
        reason = next((line for line in lines if not line.startswith(("Error merging", "full_key", "object_type"))), "")
        return f"{merging.group(1)}: {reason}"
    useful = [line for line in lines if line and not line.startswith(("To append", "full_key", "object_type"))]
    return "; ".join(dict.fromkeys(useful)) or type(error).__name__


def _plugin_note(group: str, option: str) -> str:
    """Why option ``option`` of config group ``group`` may be missing: a third-party plugin that failed to load."""
    from offload_core.registry.manager import get_registry
    from offload_core.runner.config import GROUPS

    kind = next((kind for kind, name in GROUPS.items() if name == group), None)
    return get_registry().missing_note(kind, option) if kind else ""
