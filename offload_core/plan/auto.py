"""``auto=true``: the plan step enumerates the configurations that fit the budget — every store × policy (with the
variants a policy declares, such as prefetch's depth) that takes part (``auto = True`` on its class), ``page_cache``
where the offloaded files do not fit in the page cache, and ``batch_size`` where a prompts file is given — keeping
fixed every option the user gave on the command line; predicts each (the cost model and this machine's corrections),
ranks them by predicted time for the whole run, writes the table to ``auto.json`` and ``auto.csv`` in the run folder,
prints it, and runs the first."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from offload_core.errors import OffloadError
from offload_core.registry.manager import Registry, get_registry
from offload_core.runner.settings import Settings, build_strategies
from offload_core.storage.gguf.store import NotGGUFError
from offload_core.storage.residency import offloaded_in_plan
from offload_core.values import format_size

#: the options auto=true chooses, as the command line names them
CHOSEN = ("storage", "hook", "page_cache", "batch_size")
#: batch sizes tried where a prompts file is given
BATCH_SIZES = (1, 2, 4, 8)
#: auto.csv's columns
COLUMNS = (
    "rank",
    "configuration",
    "predicted_load_s",
    "predicted_ttft_s",
    "predicted_step_s",
    "predicted_tokens_per_s",
    "predicted_total_s",
    "predicted_anon_bytes",
    "problem",
)


@dataclass
class Candidate:
    """One configuration auto=true considers: its storage and hook sections, page cache and batch size, and once
    predicted its times, anonymous memory and total time (``problem``: why it cannot run, one line)."""

    storage: dict[str, Any]
    hook: dict[str, Any]
    page_cache: str
    batch_size: int
    predicted: dict[str, float] = field(default_factory=dict)
    anon_bytes: int = 0
    offloaded_bytes: int = 0
    #: bytes the plan moves per generated token (a GGUF file's quantized ones where read in place)
    moved_bytes: int = 0
    #: for a store reading a GGUF file: what its plan keeps quantized and dequantizes, per GGML type (the plan's lines)
    gguf_lines: list[str] = field(default_factory=list)
    total_s: float = math.inf
    problem: str = ""

    @property
    def label(self) -> str:
        """The configuration as command-line options (a policy's non-default variant options included)."""
        parts = [f"storage={self.storage['name']}"]
        parts += [f"storage.{k}={v}" for k, v in self.storage.items() if k in self.storage.get("_varied", ())]
        parts += [f"hook={self.hook['name']}"]
        parts += [f"hook.{k}={v}" for k, v in self.hook.items() if k in self.hook.get("_varied", ())]
        return " ".join(parts + [f"page_cache={self.page_cache}", f"batch_size={self.batch_size}"])

    def row(self, rank: int) -> dict[str, Any]:
        step = self.predicted.get("predicted_step_s")
        return {
            "rank": rank,
            "configuration": self.label,
            "predicted_load_s": self.predicted.get("predicted_load_s"),
            "predicted_ttft_s": self.predicted.get("predicted_ttft_s"),
            "predicted_step_s": step,
            "predicted_tokens_per_s": self.batch_size / step if step else None,
            "predicted_total_s": self.total_s if math.isfinite(self.total_s) else None,
            "predicted_anon_bytes": self.anon_bytes,
            "problem": self.problem,
        }


def given_options(overrides: list[str]) -> set[str]:
    """The top-level options a Hydra override list sets (``storage=memmap``, ``hook.depth=1``, ``+page_cache=0``)."""
    return {text.lstrip("+~").split("=", 1)[0].split(".", 1)[0].split("@", 1)[0].strip() for text in overrides}


def _sections(registry: Registry, kind: str, given: dict[str, Any], fixed: bool) -> list[dict[str, Any]]:
    """The sections auto tries for a kind: the given one when fixed, else every strategy taking part, per variant."""
    if fixed:
        return [given]
    found = []
    for name in registry.names(kind):
        strategy = registry.get(kind, name)
        if not strategy.factory.auto:
            continue
        defaults = dataclasses.asdict(strategy.config())
        for variant in strategy.factory.auto_variants():
            found.append({**defaults, **variant, "_varied": tuple(variant)})
    return found or [given]


def candidates(settings: Settings, given: set[str], prompts: int, registry: Registry | None = None) -> list[Candidate]:
    """Every configuration auto tries, the options in ``given`` kept as the settings have them."""
    registry = registry or get_registry()
    stores = _sections(registry, "storage", settings.sections["storage"], "storage" in given)
    hooks = _sections(registry, "policy", settings.sections["hook"], "hook" in given)
    if settings.prompts_file and "batch_size" not in given:
        batches = sorted({b for b in BATCH_SIZES if b <= max(prompts, 1)} | {settings.batch_size})
    else:
        batches = [settings.batch_size]
    return [Candidate(s, h, settings.page_cache, b) for s in stores for h in hooks for b in batches]


def page_cache_twin(candidate: Candidate, given: set[str]) -> Candidate | None:
    """The same configuration with the other page-cache rule (``lru`` against a kept set), worth predicting only
    where the offloaded files do not fit in the page cache (otherwise both keep every page) and the user gave none."""
    from offload_core.plan.predict import fits_page_cache

    if "page_cache" in given or candidate.problem or fits_page_cache(candidate.offloaded_bytes):
        return None
    other = "auto" if candidate.page_cache == "lru" else "lru"
    return Candidate(candidate.storage, candidate.hook, other, candidate.batch_size)


def settings_of(settings: Settings, candidate: Candidate) -> Settings:
    """``settings`` with ``candidate``'s options."""
    clean = {k: v for k, v in candidate.hook.items() if k != "_varied"}
    storage = {k: v for k, v in candidate.storage.items() if k != "_varied"}
    return dataclasses.replace(
        settings,
        sections={**settings.sections, "storage": storage, "hook": clean},
        page_cache=candidate.page_cache,
        batch_size=candidate.batch_size,
    )


def evaluate(settings: Settings, candidate: Candidate, max_new_tokens: int) -> Candidate | None:
    """Plan and predict ``candidate`` (nothing loaded); a plan that cannot be made, or one over the cpu budget, is its
    ``problem``; None for a policy that does not take part for this model (:meth:`Policy.takes_part_in`)."""
    from offload_core.plan.dequant import dequant_lines
    from offload_core.plan.prepare import predict_plan, prepare, prediction_shape

    chosen = settings_of(settings, candidate)
    try:
        with prepare(chosen, build_strategies(chosen), predict=False) as job:
            if not job.strategies.policy.takes_part_in(job.run_model.model):
                return None  # it would run as another policy: left out of the table
            predict_plan(job)
            plan, storage = job.plan, job.strategies.storage
            candidate.moved_bytes = plan.predicted_bytes_per_token
            candidate.gguf_lines = [line for line in plan.conversion if line.startswith("gguf, ")]
            candidate.gguf_lines += [f"dequantizing: {line.strip()}" for line in dequant_lines(plan.dequant)[-1:]]
            devices = plan.summary["devices"]
            on_disk = devices.get("disk", {}).get("bytes", 0)
            in_memory = devices.get("cpu", {}).get("bytes", 0) + plan.reserve.get("cpu", 0) + plan.headroom
            candidate.offloaded_bytes = offloaded_in_plan(plan.summary, chosen.execution_device)
            held = plan.store_memory if plan.store_memory is not None else on_disk  # the bytes the store holds
            candidate.anon_bytes = in_memory + (held if storage.reads_from == "memory" else 0)
            candidate.predicted = dict(plan.predicted_time)
            rows = prediction_shape(job)[0]
            prompts = len(job.batches.prompts) if job.batches is not None and job.settings.prompts_file else 1
    except NotGGUFError:
        return None  # a store reading GGUF files in place, for a model that has none
    except OffloadError as error:
        if not takes_part(chosen):  # left out for this model, whatever its plan says
            return None
        candidate.problem = str(error).splitlines()[0]
        return candidate
    budget = settings.max_memory.get("cpu")
    if budget is not None and on_disk and storage.reads_from == "memory" and candidate.anon_bytes > budget:
        candidate.problem = (
            f"keeps the {format_size(held)} offloaded in memory: "
            f"{format_size(candidate.anon_bytes)}, over max_memory.cpu={format_size(budget)}"
        )
    elif not candidate.predicted.get("predicted_step_s"):
        candidate.problem = "no time prediction (the calibration could not time this model)"
    else:
        p = candidate.predicted
        per_batch = p["predicted_ttft_s"] + max(max_new_tokens - 1, 0) * p["predicted_step_s"]
        batches = math.ceil(prompts / rows)
        # the process's one-time warm-up is the same for every candidate (and paid already where a probe ran here);
        # the weights' first touch is paid by the first batch only
        once = p.get("predicted_first_call_s", 0.0) + (batches - 1) * p.get("predicted_first_touch_s", 0.0)
        candidate.total_s = p["predicted_load_s"] + batches * per_batch - once
    return candidate


def takes_part(settings: Settings) -> bool:
    """Whether the settings' policy takes part for their model (:meth:`Policy.takes_part_in`, on the empty model)."""
    from offload_core.plan.model import open_model

    strategies = build_strategies(settings)
    run_model = open_model(settings.model, settings.dtype, strategies.storage.reads_gguf)
    return strategies.policy.takes_part_in(run_model.model)


def rank(settings: Settings, given: set[str]) -> list[Candidate]:
    """Every configuration auto tries (the options in ``given`` kept as the settings have them), planned and predicted,
    fastest first (those that cannot run last)."""
    from offload_core.runner.inputs import read_prompts

    prompts = len(read_prompts(settings.prompts_file)) if settings.prompts_file else 1
    tried = []
    for candidate in candidates(settings, given, prompts):
        if evaluate(settings, candidate, settings.sampling.max_new_tokens) is None:
            continue
        tried.append(candidate)
        twin = page_cache_twin(candidate, given)
        if twin is not None:  # the same policy: it takes part as its twin does
            evaluate(settings, twin, settings.sampling.max_new_tokens)
            tried.append(twin)
    return sorted(tried, key=lambda c: (bool(c.problem), c.total_s))


def choose(settings: Settings, overrides: list[str]) -> tuple[Settings, list[dict[str, Any]]]:
    """The settings of the fastest predicted configuration and the ranked table (written to ``auto.json`` and
    ``auto.csv`` in the run folder, and printed); the options in ``overrides`` stay as given. With nothing left to
    choose, or nothing predicted, the settings as they are."""
    given = given_options(overrides)
    ranked = rank(settings, given)
    table = [c.row(place) for place, c in enumerate(ranked, 1)]
    write_table(settings, table)
    print_table(table, given)
    for line in gguf_why(ranked) + gguf_choices(ranked):
        print(line)
    best = ranked[0]
    if best.problem:
        print("auto: no candidate could be predicted; running the configuration as given")
        return settings, table
    return settings_of(settings, best), table


def write_table(settings: Settings, table: list[dict[str, Any]]) -> None:
    """``auto.json`` and ``auto.csv`` in the run folder."""
    out = settings.output_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "auto.json").write_text(json.dumps(table, indent=1))
    with open(out / "auto.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)


def _cell(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def print_table(table: list[dict[str, Any]], given: set[str]) -> None:
    """The ranked candidates, one line each: predicted load, first token, step, tokens/s, total and anonymous memory."""
    kept = ", ".join(sorted(given & set(CHOSEN))) or "none"
    print(f"auto: {len(table)} configurations predicted (kept as given: {kept}); fastest first")
    width = max(len(row["configuration"]) for row in table)
    print(f"  {'#':>3} {'configuration':<{width}}   load s  1st tok s   step s   tok/s  total s  anon mem")
    for row in table:
        if row["problem"]:
            print(f"  {row['rank']:>3} {row['configuration']:<{width}}   cannot run: {row['problem']}")
            continue
        print(
            f"  {row['rank']:>3} {row['configuration']:<{width}} {_cell(row['predicted_load_s']):>8} "
            f"{_cell(row['predicted_ttft_s']):>10} {_cell(row['predicted_step_s']):>8} "
            f"{_cell(row['predicted_tokens_per_s']):>7} {_cell(row['predicted_total_s']):>8} "
            f"{format_size(row['predicted_anon_bytes']):>9}"
        )


def gguf_why(ranked: list[Candidate]) -> list[str]:
    """Why reading a GGUF file in place ranks where it does against the converted float32 files: the fastest of
    each, their bytes moved, read from the disk and dequantized per token. Empty unless both were predicted."""
    runnable = [c for c in ranked if not c.problem]
    gguf = next((c for c in runnable if c.storage.get("name") == "gguf"), None)
    other = next((c for c in runnable if c.storage.get("name") != "gguf"), None)
    if gguf is None or other is None:
        return []

    def said(c: Candidate) -> str:
        p = c.predicted
        return (
            f"{format_size(c.moved_bytes)} moved per token, {p.get('predicted_io_s', 0.0):.3f} s reading it, "
            f"{p.get('predicted_dequant_s', 0.0):.3f} s dequantizing, {p['predicted_step_s']:.3f} s a step"
        )

    first, second = (gguf, other) if gguf.total_s <= other.total_s else (other, gguf)
    ratio = second.total_s / first.total_s if first.total_s else math.inf
    held = gguf.storage.get("resident") == "quantized"
    reading = "holding the GGUF file's quantized blocks in memory" if held else "reading the GGUF file in place"
    return [
        f"auto: {reading if first is gguf else 'the converted float32 files'} "
        f"predicted {ratio:.2f}x faster than {'the GGUF file' if first is other else 'the converted files'} "
        "over the whole run (load, first token and the decoding steps):",
        f"  storage=gguf ({gguf.label.split(' ', 1)[1]}): {said(gguf)}",
        f"  storage={other.storage['name']} ({other.label.split(' ', 1)[1]}): {said(other)}",
    ]


def gguf_choices(ranked: list[Candidate]) -> list[str]:
    """Each way of holding a GGUF file auto weighed (``storage.resident``: read from the file or held quantized in
    memory), its fastest policy: its rank, predicted step, and what its plan keeps quantized and dequantizes."""
    lines, seen = [], set()
    for place, c in enumerate(ranked, 1):
        resident = c.storage.get("resident")
        if c.storage.get("name") != "gguf" or c.problem or resident in seen:
            continue
        seen.add(resident)
        lines.append(f"auto: #{place} {c.label}: {c.predicted['predicted_step_s']:.3f} s a step predicted")
        lines += [f"    {line}" for line in c.gguf_lines]
    return lines
