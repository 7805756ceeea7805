"""The ``speculative`` options, in one place: the config group's schema and presets, and how a value is read and
checked."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from offload_core.errors import ConfigError

MODES = ("none", "prompt_lookup", "draft", "self")


@dataclass
class SpeculativeConfig:
    """How drafted tokens are made; the target checks them all in one forward pass (greedy: the same tokens)."""

    #: none, prompt_lookup (copied from the prompt and the text so far), draft (a small checkpoint sharing the
    #: tokenizer, ``path``) or self (the target's own first ``layers`` layers, its final norm and head)
    name: str = "none"
    #: the most tokens drafted per pass; the number drafted adapts to the acceptance seen (up 2 when all are
    #: accepted, down 1 when not, as transformers' "heuristic" schedule)
    tokens: int = 10
    #: draft: a local checkpoint folder whose vocabulary is the target's
    path: Optional[str] = None
    #: self: the first layers drafting (0: a quarter of the target's, at least 1)
    layers: int = 0
    #: prompt_lookup: the longest n-gram matched against the text so far
    ngram: int = 2
    #: false: always draft and check ``tokens`` (prompt_lookup; true: a draft is checked only where the passes
    #: timed say it pays) / keep transformers' constant schedule (draft, self)
    adaptive: bool = True
    #: drafting stops for the rest of a generation when, after ``probe`` passes that checked drafts, fewer than
    #: this share of the drafted tokens were accepted (0: never stops; prompt_lookup's preset); the target then
    #: decodes one token per pass without running the draft
    min_acceptance: float = 0.15
    probe: int = 4
    #: the acceptance rate the plan's prediction assumes (an estimate; the run measures the real one)
    expected_acceptance: float = 0.6

    @property
    def active(self) -> bool:
        return self.name != "none"


PRESETS = {
    "none": SpeculativeConfig(name="none"),
    # a rejected lookup costs only its verification (no draft model runs): never stop, let the length adapt
    "prompt_lookup": SpeculativeConfig(name="prompt_lookup", tokens=20, min_acceptance=0.0),
    "draft": SpeculativeConfig(name="draft", tokens=5),
    "self": SpeculativeConfig(name="self", tokens=5),
}


#: each preset in one line, and the ``speculative.*`` keys it reads (``python run.py --help``, the configuration page)
SUMMARIES = {
    "none": "no speculation: the target generates one token per pass (the default)",
    "prompt_lookup": "tokens drafted by copying what followed an n-gram earlier in the prompt or the text so far",
    "draft": "tokens drafted by a small checkpoint sharing the target's tokenizer (speculative.path)",
    "self": "tokens drafted by the target's own first layers, final norm and head",
}
_CHECKED = ("adaptive", "min_acceptance", "probe", "expected_acceptance")
PRESET_KEYS = {
    "none": (),
    "prompt_lookup": ("tokens", "ngram", *_CHECKED),
    "draft": ("tokens", "path", *_CHECKED),
    "self": ("tokens", "layers", *_CHECKED),
}


def read_speculative(value: Any) -> SpeculativeConfig:
    """``value`` (None, a mode name, a mapping or a :class:`SpeculativeConfig`) as a checked config; a value that
    cannot be used is one :class:`ConfigError` line."""
    if value is None:
        return SpeculativeConfig()
    if isinstance(value, SpeculativeConfig):
        raw = asdict(value)
    elif isinstance(value, str):
        if value not in PRESETS:
            raise ConfigError(f"speculative={value!r} is unknown: use one of {', '.join(MODES)}")
        raw = asdict(PRESETS[value])
    else:
        raw = dict(value)
        name = raw.get("name", "none")
        if name not in PRESETS:
            raise ConfigError(f"speculative.name={name!r} is unknown: use one of {', '.join(MODES)}")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"speculative has unknown key(s) {', '.join(unknown)}: known keys are {', '.join(sorted(known))}"
            )
        raw = {**asdict(PRESETS[name]), **raw}
    config = SpeculativeConfig(**raw)
    check(config)
    return config


def check(config: SpeculativeConfig) -> None:
    """Each value in range, and a draft that names its checkpoint."""
    if config.name not in MODES:
        raise ConfigError(f"speculative.name={config.name!r} is unknown: use one of {', '.join(MODES)}")
    if int(config.tokens) < 1:
        raise ConfigError(f"speculative.tokens={config.tokens} drafts nothing: give 1 or more (10 is a good start)")
    if int(config.ngram) < 1:
        raise ConfigError(
            f"speculative.ngram={config.ngram} matches nothing: give 1 or more (2 is transformers' default)"
        )
    if int(config.layers) < 0:
        raise ConfigError(
            f"speculative.layers={config.layers} is negative: give the number of first layers that draft (0: a quarter)"
        )
    if not 0.0 <= float(config.min_acceptance) <= 1.0 or int(config.probe) < 1:
        raise ConfigError(
            f"speculative.min_acceptance={config.min_acceptance} must be in [0, 1] and speculative.probe="
            f"{config.probe} 1 or more"
        )
    if not 0.0 <= float(config.expected_acceptance) < 1.0:
        raise ConfigError(
            f"speculative.expected_acceptance={config.expected_acceptance} must be in [0, 1): it is a rate"
        )
    if config.name == "draft" and not config.path:
        raise ConfigError(
            "speculative=draft needs speculative.path=<a local checkpoint folder sharing the target's tokenizer>"
        )


def expected_tokens_per_pass(config: SpeculativeConfig) -> float:
    """Tokens one pass of the target yields when each of ``tokens`` drafted tokens is accepted with the expected
    rate a, independently: (1 - a^(k+1)) / (1 - a) (Leviathan et al., 2023). 1 without speculation."""
    if not config.active:
        return 1.0
    a, k = float(config.expected_acceptance), int(config.tokens)
    return (1 - a ** (k + 1)) / (1 - a)
