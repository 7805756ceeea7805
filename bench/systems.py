"""The systems ``bench/compare.py`` compares, as ``--systems`` names them: the in-memory model (plain, with a static
KV cache, with CUDA graphs), accelerate, and ours with a policy, a store (each with options) and a mode."""

from __future__ import annotations

SYSTEM_FORM = "ours:<policy>[+key=value]:<store>[+key=value][:fit|:graphs|:hybrid] (graphs, hybrid: --device cuda only)"
#: the modes a system name may end with, and the run overrides each sets
MODES = {"fit": [], "graphs": ["graphs=true"], "hybrid": ["hybrid=true"]}
#: modes that need a CUDA GPU
GPU_MODES = ("graphs", "hybrid")


def parse_system(text: str, gpu: bool = True) -> dict | None:
    """``inmem[-static|-graphs]`` (``-static``: a static KV cache; ``-graphs``: and CUDA graphs) | ``accelerate`` |
    ``ours:...`` (:data:`SYSTEM_FORM`); None, said, for a GPU mode without ``gpu``."""
    if not gpu and text.endswith(GPU_MODES):
        return print(f"  {text}: skipped: it runs on a CUDA GPU only (use --device cuda)")
    if text in ("inmem", "accelerate", "inmem-static", "inmem-graphs"):
        return {"system": text, "kind": text[:5] if text != "accelerate" else text, "graphs": text == "inmem-graphs"}
    parts = text.split(":")
    if parts[0] != "ours" or len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] not in MODES):
        raise SystemExit(f"--systems: {text!r} is not inmem[-static|-graphs], accelerate or {SYSTEM_FORM}")
    policy, *options = parts[1].split("+")
    store, *store_options = parts[2].split("+")
    mode = parts[3] if len(parts) == 4 else None
    return {
        "system": text,
        "kind": "ours",
        "policy": policy,
        "store": store,
        "fit": mode == "fit",
        "graphs": mode == "graphs",
        "hybrid": mode == "hybrid",
        "overrides": [f"hook.{o}" for o in options] + [f"storage.{o}" for o in store_options] + MODES.get(mode, []),
    }
