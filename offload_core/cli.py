"""Command-line entry points: the Hydra main job and ``python -m offload_core plugins``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def _fail(error: BaseException) -> None:
    print(f"offload_core: error: {error}", file=sys.stderr)
    sys.exit(2)


def hydra_main() -> None:
    """Register every plugin's config, then hand over to Hydra, which calls :func:`offload_core.runner.run`."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from offload_core.config import register_configs
    from offload_core.errors import OffloadError

    try:
        register_configs()
    except OffloadError as error:
        _fail(error)

    @hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)
    def main(cfg) -> None:
        from offload_core.runner import run

        try:
            run(cfg, output_dir=HydraConfig.get().runtime.output_dir)
        except OffloadError as error:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            _fail(error)

    main()
