"""The prompts a generating run generates after, tokenised and cut into batches, and the memory the batch needs
held back from the budget before the plan is made."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from offload_core.errors import ConfigError
from offload_core.planning.batch_memory import BatchMemory
from offload_core.runner.inputs import encode_all, read_prompts
from offload_core.plan.run_memory import forward_headroom, plan_run_memory
from offload_core.runner.settings import Settings


@dataclasses.dataclass(frozen=True)
class Batches:
    """The prompts of a run, as text and as token ids, the batch size they are generated in and, once planned, the
    memory the batch needs."""

    prompts: list[str]
    encoded: list[list[int]]
    batch_size: int
    memory: BatchMemory | None = None
    #: sequences prefilled at once, when fewer than the batch (a server prefills its newcomers apart)
    prefill_rows: int | None = None

    @property
    def longest(self) -> int:
        return max(len(row) for row in self.encoded)

    @property
    def width(self) -> int:
        """The padded prompt length of a typical batch: the median over the batches of each one's longest prompt."""
        size = self.batch_size
        return int(
            statistics.median_low(
                max(len(row) for row in self.encoded[i : i + size]) for i in range(0, len(self.encoded), size)
            )
        )

    @property
    def rows(self) -> int:
        """Sequences generated at once: the batch size, or fewer when there are fewer prompts."""
        return min(self.batch_size, len(self.prompts))


def read_batches(settings: Settings, run_model: Any) -> tuple[Settings, Batches | None]:
    """The prompts a generating run generates after, tokenised, in batches: the ``prompts`` file in batches of
    ``batch_size``, or ``prompt`` as a batch of one; their memory planned (:func:`plan_run_memory`, which resolves
    ``headroom=auto``). A run that does not generate gets None and, under ``headroom=auto``, a fixed headroom."""
    from offload_core.loading.tasks import GENERATIVE

    if settings.resume and not settings.prompts_file:
        raise ConfigError(
            "resume goes on with a prompts run: give the same prompts=<file> (and settings) as the run you resume"
        )
    if run_model.task not in GENERATIVE:
        return forward_headroom(settings), None
    chat = settings.chat_template
    if not settings.prompts_file:
        batches = Batches([settings.prompt], encode_all(run_model, [settings.prompt], chat), 1)
    else:
        if settings.resume:  # the earlier run's folder: its generations go on there
            settings = dataclasses.replace(settings, output_dir=resume_folder(settings.resume))
        if settings.batch_size < 1:
            raise ConfigError(f"batch_size={settings.batch_size} must be at least 1")
        prompts = read_prompts(settings.prompts_file)
        batches = Batches(prompts, encode_all(run_model, prompts, chat), settings.batch_size)
    return plan_batches(settings, run_model, batches)


def plan_batches(settings: Settings, run_model: Any, batches: Batches) -> tuple[Settings, Batches]:
    """``settings`` with the memory ``batches`` need held back (:func:`plan_run_memory`), and ``batches`` with it."""
    settings, need = plan_run_memory(settings, run_model, batches.rows, batches.longest, batches.prefill_rows)
    return settings, dataclasses.replace(batches, memory=need)


#: what a prompts run writes in its folder first (:mod:`offload_core.jobs.journal`): a folder to resume holds it
RUN_FILE = "generations.run.json"


def resume_folder(value: Any) -> Path:
    """``resume``'s run folder, which must exist and be a prompts run's (nothing is written in another folder)."""
    folder = Path(str(value)).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"resume={value} is not a folder: give the folder of the run to go on with "
            "(e.g. resume=outputs/2026-01-31/12-00-00)"
        )
    if not (folder / RUN_FILE).is_file():
        raise ConfigError(
            f"resume={value}: the folder holds no {RUN_FILE}, so it is not a prompts run's folder; give the folder "
            "of the run to go on with"
        )
    return folder


def run_in_resumed_folder(args: list[str]) -> list[str]:
    """``run.py``'s arguments (as Hydra reads them) with a single run's ``resume=<folder>`` run in that folder: Hydra
    makes no new, empty run folder for it (``hydra.run.dir`` is that folder), and the folder's ``.hydra/`` stays the
    record of the run that made its generations (the resumed run's settings must be the same; its overrides go to
    ``metrics.json``). A folder that is not there is one line before anything is made; a multirun, and a
    ``hydra.run.dir`` the user gives, are left as they are."""
    import re

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from offload_core.runner.overrides import quote

    if any(a in ("-m", "--multirun") or re.match(r"[+~]*hydra\.(run\.dir|output_subdir)=", a) for a in args):
        return args
    given = [a for a in args if re.match(r"\+*resume=", a)]
    value = OverridesParser.create().parse_overrides(given[-1:])[0].value() if given else None
    if value in (None, ""):
        return args
    folder = resume_folder(value)
    return [*args, f"hydra.run.dir={quote(str(folder))}", "hydra.output_subdir=null"]
