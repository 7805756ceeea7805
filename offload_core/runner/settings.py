"""A composed config read once, at the edge, into typed values: devices and sizes parsed, the prompts, sampling and
run switches as plain fields, each strategy section a dict; nothing below the edge reads the raw config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from offload_core import defaults, devices
from offload_core.errors import ConfigError
from offload_core.registry.contracts import Placement, Policy, Storage
from offload_core.registry.manager import Registry, get_registry
from offload_core.planning.budgets import check_over_budget
from offload_core.runner.config import GROUPS
from offload_core.speculative import SpeculativeConfig, read_speculative
from offload_core.values import budget_key, device_key, parse_dtype, parse_size


@dataclass(frozen=True)
class Sampling:
    """How many tokens a run generates after its prompt and how it picks them (greedy unless ``do_sample``)."""

    max_new_tokens: int = 16
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    seed: int = 0

    def generate_kwargs(self) -> dict[str, Any]:
        """The arguments ``model.generate`` takes for them."""
        kwargs: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample}
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        return kwargs


@dataclass
class Settings:
    """A composed config read once: devices, budgets and sizes parsed, the inputs and switches typed, each strategy
    section a plain dict (``sections``: "placement", "storage", "hook", "model", "pipeline")."""

    execution_device: torch.device
    max_memory: dict[Any, int]
    headroom: int | None  # None: planned for the run's prompts (see offload_core.plan.batches.read_batches)
    dtype: torch.dtype | None
    output_dir: Path
    sections: dict[str, dict]
    #: the prompt a single run generates from (or an encoder's one text), the encoder's texts, the prompts file
    prompt: str = ""
    texts: list[str] | None = None
    prompts_file: str | None = None
    batch_size: int = 1
    resume: str | None = None
    sampling: Sampling = field(default_factory=Sampling)
    speculative: SpeculativeConfig = field(default_factory=lambda: read_speculative(None))
    offload_folder: str | None = None
    device_map_file: str | None = None
    page_cache: str = "auto"
    over_budget: str = defaults.OVER_BUDGET
    compare_in_memory: bool = False
    plan_only: bool = False
    #: compute a share of the offloaded blocks on the host in decoding steps (:mod:`offload_core.plan.hybrid`)
    hybrid: bool = False
    progress: bool = True
    calibrate: bool = False
    #: pick the fastest predicted configuration among those that fit (:mod:`offload_core.plan.auto`)
    auto: bool = False
    #: capture decoding steps in a graph and replay them (:mod:`offload_core.module_hooks.graphs`)
    graphs: bool = False
    #: ``dtype`` as given (``auto``: the checkpoint's): what a resumed run must match
    dtype_name: str = "auto"
    #: run or serve (``sections["serve"]`` holds the server's keys)
    mode: str = "run"

    @property
    def model(self) -> dict:
        return self.sections["model"]

    @property
    def pipeline(self) -> dict:
        return self.sections["pipeline"]

    @property
    def chat_template(self) -> bool:
        return bool(self.model.get("chat_template", True))

    @property
    def budget_key(self) -> Any:
        """The budget key of the device the run computes on: ``cpu``, or its GPU's index."""
        return budget_key(self.execution_device)

    @property
    def budgets(self) -> dict[Any, int]:
        """``max_memory`` as the placement fills it: the budget of the device the run computes on (the cpu, or
        its GPU: activations, the KV cache and the accelerator's workspaces live there) less the headroom."""
        budgets = dict(self.max_memory)
        key = self.budget_key
        if key in budgets:
            assert self.headroom is not None, "the headroom is planned before the budgets are used"
            budgets[key] = max(budgets[key] - self.headroom, 0)
        return budgets


@dataclass
class Strategies:
    """The placement, storage and module-hook policy a run composes, and the names they were picked by."""

    placement: Placement
    storage: Storage
    policy: Policy
    names: dict[str, str]  # config group -> chosen name

    @property
    def policy_name(self) -> str:
        return self.names["hook"]

    def planned(self, policy: Policy | None) -> Strategies:
        """These strategies with the policy the plan was made for (it may hold fewer units in flight than asked:
        :func:`offload_core.plan.make.fit_in_flight`)."""
        return self if policy is None or policy is self.policy else dataclasses.replace(self, policy=policy)

    def __str__(self) -> str:
        return " ".join(f"{group}={name}" for group, name in self.names.items())


def _section(cfg: Any, key: str) -> dict:
    node = cfg.get(key) if isinstance(cfg, DictConfig) else cfg[key]
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def read_settings(cfg: Any, output_dir: str | Path | None = None) -> Settings:
    """Parse ``cfg`` (a composed config) once; a value that cannot be used is a :class:`ConfigError`."""
    from offload_core.runner.overrides import check_keys
    from offload_core.planning.headroom import check_headroom
    from offload_core.runner.validate import check_generation

    check_keys(cfg)
    check_generation(cfg)
    device = execution_device(cfg.execution_device)
    budgets = max_memory(_section(cfg, "max_memory"), device)
    headroom = None if str(cfg.headroom) == "auto" else parse_size(cfg.headroom, what="headroom")
    if headroom is not None:
        check_headroom(budgets, headroom, device)
    texts = cfg.get("texts")
    sections = {key: _section(cfg, key) for key in ("placement", "storage", "hook", "model", "pipeline")}
    sections["model"] = local_model(sections["model"], bool(cfg.progress))
    sections["serve"] = _section(cfg, "serve") if "serve" in cfg else {}
    return Settings(
        execution_device=device,
        max_memory=budgets,
        headroom=headroom,
        dtype=parse_dtype(cfg.dtype),
        output_dir=Path(output_dir) if output_dir else Path.cwd(),
        sections=sections,
        prompt=str(cfg.prompt),
        texts=[str(text) for text in texts] if texts else None,
        prompts_file=str(cfg.prompts) if cfg.get("prompts") else None,
        batch_size=int(cfg.batch_size),
        resume=str(cfg.resume) if cfg.get("resume") else None,
        sampling=Sampling(
            int(cfg.max_new_tokens),
            bool(cfg.do_sample),
            float(cfg.temperature),
            int(cfg.top_k),
            float(cfg.top_p),
            int(cfg.seed),
        ),
        speculative=run_speculative(cfg),
        offload_folder=cfg.offload_folder,
        device_map_file=cfg.device_map,
        page_cache=str(cfg.page_cache),
        over_budget=check_over_budget(str(cfg.get("over_budget", defaults.OVER_BUDGET))),
        compare_in_memory=bool(cfg.compare_in_memory),
        plan_only=bool(cfg.plan_only),
        hybrid=bool(cfg.get("hybrid", False)),
        progress=bool(cfg.progress),
        calibrate=bool(cfg.get("calibrate", False)),
        auto=bool(cfg.get("auto", False)),
        graphs=run_graphs(cfg, device, sections),
        dtype_name=str(cfg.dtype),
        mode=run_mode(cfg),
    )


def local_model(section: dict, progress: bool) -> dict:
    """The run's ``model`` section with ``path`` a local folder: a Hub repo id's snapshot folder in the Hugging Face
    cache (downloaded first, unless ``HF_HUB_OFFLINE=1``, with ``progress`` bars), ``repo_id`` the id given."""
    from offload_core.loading.hub import resolve_model_path

    path = section.get("path")
    if not path:
        return section
    folder = resolve_model_path(path, revision=section.get("revision"), progress=progress)
    return section if folder == Path(path).expanduser() else {**section, "path": str(folder), "repo_id": str(path)}


def run_graphs(cfg: Any, device: torch.device, sections: dict[str, dict]) -> bool:
    """``graphs``, checked against the run it is asked of (a :class:`GraphsError` naming why it cannot apply)."""
    from offload_core.errors import GraphsError
    from offload_core.module_hooks.graphs import graphs_refusal

    if not bool(cfg.get("graphs", False)):
        return False
    speculative = run_speculative(cfg).name != "none"
    pinned = sections["storage"].get("name") == "pinned_cpu"
    refusal = graphs_refusal(device, str(sections["hook"].get("name")), pinned, speculative)
    if refusal is None and cfg.get("auto", False):
        refusal = "graphs=true keeps the store and policy given; auto=true picks them: drop one of them"
    if refusal is not None:
        raise GraphsError(refusal)
    return True


def run_mode(cfg: Any) -> str:
    """``mode``: run or serve."""
    mode = str(cfg.get("mode", "run"))
    if mode not in ("run", "serve"):
        raise ConfigError(f"mode={mode} is not a mode: use mode=run (the default) or mode=serve (an HTTP server)")
    return mode


def run_speculative(cfg: Any) -> SpeculativeConfig:
    """The run's ``speculative`` section, checked (absent: none)."""
    node = cfg.get("speculative") if hasattr(cfg, "get") else None
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    return read_speculative(node)


def build_strategies(settings: Settings, registry: Registry | None = None) -> Strategies:
    """Build the strategies the config's ``placement``, ``storage`` and ``hook`` sections name."""
    registry = registry or get_registry()
    built = {
        kind: registry.create(kind, settings.sections[group]["name"], settings.sections[group])
        for kind, group in GROUPS.items()
    }
    names = {group: settings.sections[group]["name"] for group in GROUPS.values()}
    return Strategies(built["placement"], built["storage"], built["policy"], names)


def execution_device(value: str | None) -> torch.device:
    """``execution_device`` as a torch device: ``auto``/empty picks GPU 0 of the machine's accelerator when it has
    one (:func:`offload_core.devices.default_execution_device`), else ``cpu``; another value is checked by
    :func:`offload_core.planning.budgets.check_execution_device`."""
    if value in (None, "", "auto"):
        return devices.default_execution_device()
    from offload_core.planning.budgets import check_execution_device

    return check_execution_device(value)


def max_memory(raw: dict, execution_device: torch.device) -> dict[Any, int]:
    """The ``max_memory`` section as budgets in bytes keyed like a device map (GPU index, ``cpu``, ``disk``); a key
    of null is left out (:func:`offload_core.planning.check_budgets` checks the rest)."""
    from offload_core.planning.budgets import check_budgets

    budgets: dict[Any, int] = {}
    for key, value in raw.items():
        key_s = str(key)
        dev = device_key(key_s)
        if dev is None or dev == "mps":
            raise ConfigError(f"max_memory has an unknown device {key_s!r}: use cpu, disk or a GPU index like 0")
        if isinstance(dev, int) and execution_device.type == "cpu":
            check_budgets({dev: 1}, execution_device)
        if value is None:
            continue
        budgets[dev] = parse_size(value, what=f"max_memory.{key_s}")
    check_budgets(budgets, execution_device)
    return budgets
