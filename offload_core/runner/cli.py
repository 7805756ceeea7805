"""Command-line entry points: the Hydra main job and ``python -m offload_core plugins``."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

from offload_core.runner.console import print_line


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM, so a terminated run unwinds (and cleans up) as an interrupted one does."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated()


def _fail(error: BaseException) -> None:
    print_line(f"error: {error}")
    sys.exit(2)


def _error_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _say_failed_plugins() -> None:
    """One line per third-party plugin that failed to load: the run goes on without it, never silently."""
    from offload_core.registry.manager import disable_hint, get_registry

    for plugin, why in get_registry().failed.items():
        print_line(f"plugin {plugin!r} failed to load and is skipped ({why}); {disable_hint(plugin)}")


def hydra_main(command: str = "python run.py") -> None:
    """Register every plugin's config, then hand over to Hydra, which calls :func:`offload_core.runner.job.run`
    (``command``: how the user started it, as ``--help`` names it).

    In a multirun, a failed job is recorded (its ``metrics.json`` holds the one-line error) and the
    sweep goes on; a single run fails with one line and exit code 2.
    """
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from offload_core.errors import OffloadError
    from offload_core.runner.config import CONF_DIR, register_configs
    from offload_core.runner.options import register_help_resolver
    from offload_core.runner.overrides import check_composes, check_parses, prepare
    from offload_core.plan.batches import run_in_resumed_folder

    try:
        register_configs()
        _say_failed_plugins()
        register_help_resolver(command)
        args = prepare(sys.argv[1:])
        check_parses(args)
        check_composes(args, CONF_DIR)
        args = run_in_resumed_folder(args)
    except OffloadError as error:
        _fail(error)
    sys.argv = [sys.argv[0], *args]

    @hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)
    def main(cfg) -> None:
        from offload_core.runner.job import run

        hc = HydraConfig.get()
        labels = {
            "choices": {k: hc.runtime.choices.get(k) for k in ("placement", "storage", "hook", "model")},
            "overrides": list(hc.overrides.task),
        }
        output_dir = Path(hc.runtime.output_dir)
        try:
            run(cfg, output_dir=output_dir, labels=labels)
        except Exception as error:
            if hc.mode == RunMode.MULTIRUN:
                output_dir.mkdir(parents=True, exist_ok=True)
                message = str(error) if isinstance(error, OffloadError) else _error_line(error)
                (output_dir / "metrics.json").write_text(json.dumps({**labels, "error": message}, indent=1))
                print_line(f"job failed: {message}")
                return
            if isinstance(error, OffloadError) and os.environ.get("HYDRA_FULL_ERROR") != "1":
                _fail(error)
            raise

    previous = (
        signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        main()
    except Terminated:
        # SIGTERM (timeout, a batch system's preemption) unwinds like Ctrl-C: stores close, temporary folders go.
        print_line("terminated (SIGTERM); temporary files were removed")
        sys.exit(143)
    except KeyboardInterrupt:
        # Stores were closed on the way out (temporary offload folders removed); no traceback for Ctrl-C.
        print_line("interrupted (Ctrl-C); temporary files were removed")
        sys.exit(130)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
