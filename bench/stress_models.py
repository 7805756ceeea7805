"""The model runs of ``bench/stress_mapped.py``: a small Mixtral offloaded whole, its experts computed on the store's
mapped views (safetensors read in place, an offload folder) or streamed by the prefetch policy, generating while a
thread drops every page it maps and tries to close the mappings under its views; each model then removed or simply
let go and collected. Every run's tokens must be the in-memory model's."""

from __future__ import annotations

import gc
import random
import threading
import time
from pathlib import Path

import torch


def _checkpoint(root: Path) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A Mixtral whose per-expert tensors span whole pages, saved by transformers; a prompt and its reference tokens."""
    import transformers

    config = transformers.MixtralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    path = root / "mixtral"
    model.save_pretrained(path)
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0
        )
    return path, ids, want


def _harass(model, stop: threading.Event, counts) -> None:
    """While ``model`` generates: drop the pages of every tensor its store maps, try to close the mappings under its
    views (refused while a view lives). An error here is a failure of the run."""
    try:
        _drop_and_close(model, stop, counts)
    except BaseException as error:  # noqa: BLE001 - any error of the thread is a failure
        counts.fail(f"harassing a model: {type(error).__name__}: {error}")


def _drop_and_close(model, stop: threading.Event, counts) -> None:
    from offload_core.storage.mapping import mapping_of

    store = model.offload_state.store
    keys = list(store)
    while not stop.is_set():
        key = random.choice(keys)
        counts.add("model pages dropped", int(store.drop(key)))
        view = store.mapped_view(key)
        mapping = mapping_of(view) if view is not None else None
        if mapping is not None:
            try:
                mapping.close()
                counts.add("model mapping closed under a view")
            except BufferError:
                counts.add("model close refused under a view")
        del view, mapping
        time.sleep(0.001)


def run_models(root: Path, deadline: float, counts) -> None:
    """Models run one after another until ``deadline``, each against a thread that harasses its mappings."""
    import offload_core
    from offload_core.module_hooks.experts import Experts, ExpertsConfig

    path, ids, want = _checkpoint(root)
    runs = 0
    while time.monotonic() < deadline:
        storage = random.choice(["safetensors", "memmap"])
        policy = random.choice(["experts", "prefetch"])
        chosen = Experts(ExpertsConfig(guess="router", cache_slots=1)) if policy == "experts" else "prefetch"
        model = offload_core.from_pretrained(
            path,
            offload={
                "device_map": {"": "disk"},
                "storage": storage,
                "policy": chosen,
                "offload_folder": root / f"off{runs % 3}",
            },
        )
        stop = threading.Event()
        harasser = threading.Thread(target=_harass, args=(model, stop, counts), daemon=True)
        harasser.start()
        try:
            with torch.no_grad():
                got = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0
                )
        finally:
            stop.set()
            harasser.join()
        if not torch.equal(got, want):
            counts.fail(f"model tokens differ ({storage}, {policy})")
        counts.add(f"model runs {storage} {policy}")
        if random.random() < 0.5:
            model.offload_state.remove()
        del model  # else let go with its store open: collected below, its mappings with its last view
        gc.collect()
        runs += 1
        counts.write()
