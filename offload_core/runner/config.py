"""A run's config schemas in Hydra's ConfigStore: the top-level keys, the model presets and every registered
strategy's config dataclass (:mod:`offload_core.runner.settings` reads a composed config once)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from offload_core import defaults
from offload_core.registry.manager import Registry, get_registry

#: the folder of ``config.yaml`` and the config groups' YAML options: ``offload_core/conf`` in an installed wheel (the
#: repository's ``conf/``, packaged there by pyproject.toml), else the checkout's ``conf/`` beside the package
_PACKAGED = Path(__file__).resolve().parents[1] / "conf"
CONF_DIR = str(_PACKAGED if (_PACKAGED / "config.yaml").is_file() else Path(__file__).resolve().parents[2] / "conf")

#: registry kind -> its Hydra config group (users pick a module-hook policy with ``hook=``)
GROUPS = {"placement": "placement", "storage": "storage", "policy": "hook"}


@dataclass
class ModelConfig:
    """Which checkpoint to run. ``path`` (a local Hugging Face checkpoint folder, or a Hub repo id) wins over
    ``name``."""

    #: smollm2 (embedded default), synthetic (random Llama of a preset size) or local (needs path)
    name: str = "smollm2"
    #: a checkpoint folder (a Hub cache snapshot folder too), a GGUF file, or a Hub repo id such as org/name (an
    #: existing local path wins): taken from the Hugging Face cache, downloaded first unless HF_HUB_OFFLINE=1; a GGUF
    #: repo's quantization after a colon (org/name-GGUF:Q4_K_M); a model Ollama pulled as ollama:name:tag
    path: Optional[str] = None
    #: the branch, tag or commit of a Hub repo id given as path (default: main)
    revision: Optional[str] = None
    #: synthetic only: tiny, small, 0.3b, 1.1b, 3.4b, 30b
    preset: str = "tiny"
    #: apply the tokenizer's chat template to the prompt
    chat_template: bool = True
    #: module classes never split across devices (default: the model's own ``_no_split_modules``)
    no_split_module_classes: Optional[List[str]] = None
    #: causal_lm, seq2seq_lm, masked_lm, sequence_classification or embeddings (default: from config.architectures)
    task: Optional[str] = None
    #: what reads the prompt and texts: null (the checkpoint folder's own tokenizer files), a folder or Hub repo id
    #: holding the model's tokenizer, or bytes (one id per UTF-8 byte: only for test models built without one)
    tokenizer: Optional[str] = None


@dataclass
class PipelineConfig:
    """What a diffusers pipeline run (``model.path`` holding ``model_index.json``) reads besides ``prompt``,
    ``prompts``, ``batch_size`` and ``seed``."""

    #: what the image should not show (pipelines with classifier-free guidance)
    negative_prompt: Optional[str] = None
    #: denoising steps per image
    num_inference_steps: int = 20
    #: image height in pixels (default: the pipeline's own)
    height: Optional[int] = None
    #: image width in pixels (default: the pipeline's own)
    width: Optional[int] = None
    #: classifier-free guidance scale (1 or less: none)
    guidance_scale: float = 7.5
    #: components no larger than this move whole (chained: each stays until the next is called); larger ones split at
    #: their own blocks, a block over it at its inner blocks. auto: the execution device's budget shared by the
    #: policy's units in flight and what runs beside them (half for chained); a size; 0 splits every component at
    #: its blocks
    whole_components: str = "auto"


@dataclass
class ServeConfig:
    """``mode=serve``: the OpenAI-compatible server (offload_core.serve) and its continuous batching."""

    #: the address to listen on (loopback by default; 0.0.0.0 listens on every interface)
    host: str = "127.0.0.1"
    #: the port to listen on (0: a free port, printed when the server is ready)
    port: int = 8000
    #: a key every request but GET /health must carry (Authorization: Bearer <key>); default: the environment's
    #: OFFLOAD_CORE_API_KEY, else none
    api_key: Optional[str] = None
    #: the name clients give as "model" (default: the model's folder name, or model.name)
    model_name: Optional[str] = None
    #: tokens each request may hold, prompt and completion together (capped at the model's context); its KV cache is
    #: planned for this many
    context: int = 1024
    #: requests generated at once: auto (as many as the budget holds at serve.context, up to 16) or a number
    max_batch: Any = "auto"
    #: requests waiting for a slot beyond those generating; past it a request is answered 429
    max_queue: int = 64
    #: max_tokens of a request that gives none (then capped by what serve.context leaves after its prompt)
    max_tokens: int = 256
    #: each request computes in its own forward, so its tokens are those it gets alone (no shared pass)
    exact: bool = False
    #: seconds in-flight requests get to finish after SIGTERM or Ctrl-C before they are cancelled
    shutdown_timeout: float = 30.0
    #: copies of the server behind Ray Serve's HTTP proxy on serve.host:serve.port, each loading its own offloaded
    #: model (1 and no serve.ray_address: one server in this process, no Ray)
    replicas: int = 1
    #: the Ray cluster the replicas run on: null starts a local one; "auto" or ray://<head>:10001 joins a cluster
    ray_address: Optional[str] = None
    #: CPU cores Ray reserves for each replica (on a GPU run each replica also takes one GPU of its own)
    replica_cpus: float = 1.0


@dataclass
class RunConfig:
    """Top-level keys of ``conf/config.yaml``."""

    placement: Any = MISSING
    storage: Any = MISSING
    hook: Any = MISSING
    model: ModelConfig = MISSING
    #: speculative decoding (offload_core.speculative.config.SpeculativeConfig): none, prompt_lookup, draft, self
    speculative: Any = None
    #: run (generate, or read texts, and exit) or serve (an OpenAI-compatible server: see the serve keys)
    mode: str = "run"
    #: mode=serve only
    serve: ServeConfig = field(default_factory=ServeConfig)
    #: the prompt a single run generates from (a causal_lm or seq2seq_lm model), or its one text
    prompt: str = "What is the capital of France?"
    #: the texts a masked_lm, sequence_classification or embeddings run reads at once (default: [prompt])
    texts: Optional[List[str]] = None
    #: a file of prompts (one per line, or JSON lines with a "prompt" field) generated in batches instead of ``prompt``
    prompts: Optional[str] = None
    #: prompts generated at once when ``prompts`` is given (left-padded; the KV cache is planned for it)
    batch_size: int = defaults.BATCH_SIZE
    #: the folder of an interrupted prompts run to go on with: its finished prompts are kept, the rest generated there
    resume: Optional[str] = None
    #: tokens generated after the prompt (greedy unless do_sample)
    max_new_tokens: int = defaults.MAX_NEW_TOKENS
    #: sample with temperature, top_k and top_p instead of greedy decoding
    do_sample: bool = False
    #: sampling temperature (above 0; do_sample only)
    temperature: float = 1.0
    #: sample from the k likeliest tokens (do_sample only)
    top_k: int = 50
    #: nucleus sampling: the smallest set of tokens whose probability reaches top_p, in (0, 1] (do_sample only)
    top_p: float = 1.0
    #: budget per device: {"cpu": "200MiB", "0": "10GiB"}; sizes are strings or bytes
    max_memory: Dict[str, Any] = field(default_factory=lambda: {"cpu": "200MiB"})
    #: held back from the budget of the device that computes (the cpu, or the GPU) for activations, KV cache and
    #: logits: auto plans them for the prompt (or the batch) and max_new_tokens, for a diffusers pipeline traces its
    #: call's activations (48MiB for another run that does not generate); a size holds that back instead
    headroom: str = defaults.HEADROOM
    #: auto (the checkpoint's), float32, bfloat16, float16
    dtype: str = "auto"
    #: where the memmap store writes (a temporary folder, removed at exit, when null)
    offload_folder: Optional[str] = None
    #: a JSON device map to use instead of the placement's
    device_map: Optional[str] = None
    #: cpu, cuda, cuda:N (default: cuda:0 when present, else cpu)
    execution_device: Optional[str] = None
    #: the random seed set before generating (matters with do_sample)
    seed: int = 0
    #: also run the model fully in memory and record whether the tokens match
    compare_in_memory: bool = False
    #: print the plan (device map, bytes per device, reservation) and stop before loading anything
    plan_only: bool = False
    #: on a GPU run with hook=prefetch: decoding steps of one sequence compute a share of the offloaded blocks on the
    #: host from their host-resident weights while the others stream in, the split solved from measured rates (tokens
    #: then differ from the all-GPU run by CPU/GPU rounding only; prefill and batches stream every block)
    hybrid: bool = False
    #: offloaded blocks kept in the page cache across tokens (the rest are streamed and dropped after
    #: use): auto (the memory available at load less a safety margin), a size (0 streams everything),
    #: or lru (keep no set: the kernel's page cache decides)
    page_cache: str = defaults.PAGE_CACHE
    #: where the plan cannot keep a budget (the policy's units in flight, a block larger than it): warn (run over it by
    #: the amount a warning line names) or refuse (one error line, nothing loaded)
    over_budget: str = defaults.OVER_BUDGET
    #: show progress bars (loading, prompts); TQDM_DISABLE=1 hides them too
    progress: bool = True
    #: measure the machine again (disk and host-to-device bandwidth, one block's compute) for the time prediction
    calibrate: bool = False
    #: pick the configuration predicted fastest among those that fit the budget: every store x policy (and prefetch
    #: depth), page_cache where the offloaded files outgrow the page cache, batch_size with prompts; the options given
    #: on the command line stay as given. Writes the ranked table to auto.json and auto.csv (plan_only=true: only that)
    auto: bool = False
    #: capture one-token decoding steps (static KV cache) in a CUDA graph and replay them: a CUDA GPU, and where
    #: anything is offloaded hook=prefetch storage=pinned_cpu (offloaded blocks stream by a fixed ring of slots)
    graphs: bool = False
    #: diffusers pipelines only
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)


MODEL_PRESETS = {
    "smollm2": ModelConfig(name="smollm2"),
    "synthetic": ModelConfig(name="synthetic", preset="tiny", chat_template=False),
    "local": ModelConfig(name="local", path=MISSING),
}


def register_configs(registry: Registry | None = None) -> ConfigStore:
    """Store the run schema, the model presets and every registered strategy's config dataclass."""
    registry = registry or get_registry()
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for name, node in MODEL_PRESETS.items():
        cs.store(group="model", name=name, node=node)
    for kind, group in GROUPS.items():
        for name in registry.names(kind):
            cs.store(group=group, name=name, node=registry.get(kind, name).config)
    from offload_core.speculative.config import PRESETS

    for name, node in PRESETS.items():  # speculative=none|prompt_lookup|draft|self
        cs.store(group="speculative", name=name, node=node)
    return cs
