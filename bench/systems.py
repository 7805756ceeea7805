"""The systems ``bench/compare.py`` compares, as ``--systems`` names them: the in-memory model (plain, with a static
KV cache, with CUDA graphs), accelerate, and ours with a policy, a store and options."""

from __future__ import annotations

SYSTEM_FORM = "ours:<policy>[+key=value]:<store>[:fit|:graphs] (graphs: --device cuda only)"


def parse_system(text: str, gpu: bool = True) -> dict | None:
    """``inmem[-static|-graphs]`` (``-static``: a static KV cache; ``-graphs``: and CUDA graphs) | ``accelerate`` |
    ``ours:...`` (:data:`SYSTEM_FORM`); None, said, for a graphs system without ``gpu`` (graphs capture CUDA work)."""
    if text.endswith("graphs") and not gpu:
        return print(f"  {text}: skipped: graphs capture decoding steps on a CUDA GPU (use --device cuda)")
    if text in ("inmem", "accelerate", "inmem-static", "inmem-graphs"):
        return {"system": text, "kind": text[:5] if text != "accelerate" else text, "graphs": text == "inmem-graphs"}
    parts = text.split(":")
    if parts[0] != "ours" or len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] not in ("fit", "graphs")):
        raise SystemExit(f"--systems: {text!r} is not inmem[-static|-graphs], accelerate or {SYSTEM_FORM}")
    policy, *options = parts[1].split("+")
    return {
        "system": text,
        "kind": "ours",
        "policy": policy,
        "store": parts[2],
        "fit": parts[3:] == ["fit"],
        "graphs": parts[3:] == ["graphs"],
        "overrides": [f"hook.{o}" for o in options] + ["graphs=true"] * (parts[3:] == ["graphs"]),
    }
