"""A third-party plugin as pip would leave it installed: its modules and a ``.dist-info`` folder (METADATA and
``offload_core`` entry points) written into a site folder, which a test puts on ``sys.path`` or ``PYTHONPATH``."""

from __future__ import annotations

import textwrap
from pathlib import Path

#: a placement plugin's module: registers ``every_other`` (with ``make_device_map`` unless ``lacking``)
PLACEMENT_PLUGIN = """
from dataclasses import dataclass
from offload_core.hookspecs import hookimpl

@dataclass
class EveryOtherConfig:
    name: str = "every_other"

class EveryOther:
    def __init__(self, config):
        self.config = config
{make_device_map}
@hookimpl
def offload_register_placements(register):
    register("every_other", EveryOther, EveryOtherConfig)
"""

MAKE_DEVICE_MAP = """
    def make_device_map(self, request):
        return {"": "cpu"}
"""


def placement_plugin(lacking: bool = False) -> str:
    """The source of a module registering the placement ``every_other`` (without ``make_device_map`` if
    ``lacking``)."""
    return PLACEMENT_PLUGIN.format(make_device_map="" if lacking else MAKE_DEVICE_MAP)


def install_distribution(
    site: Path, name: str, version: str, entry_points: dict[str, str], files: dict[str, str] | None = None
) -> Path:
    """Write the distribution ``name`` ``version`` into ``site`` (made if missing): each of ``files`` (relative path
    -> Python source, dedented) and ``<name>-<version>.dist-info`` whose ``offload_core`` entry points are
    ``entry_points`` (entry point name -> ``module`` or ``module:attribute``). Returns ``site``."""
    site.mkdir(parents=True, exist_ok=True)
    for relative, source in (files or {}).items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        "[offload_core]\n" + "".join(f"{entry} = {target}\n" for entry, target in entry_points.items())
    )
    return site
