"""Speculative decoding under offload: several tokens checked per pass over the streamed weights.

``config``: the options (none, prompt_lookup, draft, self); ``drafts``: the draft models (a checkpoint kept
resident, or the target's first layers shared); ``counting``: the passes, drafted and accepted tokens, and the
adaptive number of prompt-lookup tokens; ``Speculation`` ties them to one target model.
"""

from offload_core.speculative.config import MODES, SpeculativeConfig, read_speculative
from offload_core.speculative.counting import Speculation, prepare

__all__ = ["MODES", "Speculation", "SpeculativeConfig", "prepare", "read_speculative"]
