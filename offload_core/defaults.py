"""The one set of defaults every door reads (``run.py``, :func:`offload_core.from_pretrained`,
:func:`offload_core.load_checkpoint_and_dispatch`): the strategies, the page-cache rule and the generation a plan
holds memory for, so the same request gives the same plan whichever door it comes in by."""

from __future__ import annotations

#: the placement that makes the device map: fills the execution device first, then the cpu, then disk
PLACEMENT = "sequential"
#: the store: offloaded weights read in place from the checkpoint's safetensors files, nothing written at load (with
#: every policy as fast per token as memmap, and sooner to load: bench/results/compare-1.1b.md, compare-1.1b-cold.md)
STORAGE = "safetensors"
#: the module-hook policy, for transformers models and diffusers pipelines alike: one unit in flight at a time, the
#: least memory beside the weights (the policies decode within noise of one another in the same result files)
POLICY = "align_per_call"
#: the page-cache rule: a kept set of the offloaded blocks sized to the memory available at load, the rest streamed
PAGE_CACHE = "auto"
#: what is held back beside the weights: ``auto`` plans the generation's KV cache and activations (a pipeline's traced
#: call), a size holds that back instead
HEADROOM = "auto"
#: the generation a plan holds memory for: tokens generated after the prompt
MAX_NEW_TOKENS = 16
#: sequences generated at once
BATCH_SIZE = 1
#: prompt tokens a Python door plans for when not told (``run.py`` counts its prompt's; its default prompt, under
#: SmolLM2's chat template, is about 30)
PROMPT_TOKENS = 32
#: a budget the plan cannot hold (a block larger than it, the policy's units in flight): refused in one line naming by
#: how much (``warn`` runs over it instead, a warning line naming by how much)
OVER_BUDGET = "refuse"
