"""Plan reports made before anything is loaded: the plan as text and a placement picture."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from offload_core.devices import gpu
from offload_core.values import format_size

TIER_COLOURS = {"gpu": "tab:green", "cpu": "tab:blue", "disk": "tab:orange", "other": "tab:gray"}


def _tier(device: Any) -> str:
    if isinstance(device, int):
        return "gpu"
    return device if device in ("cpu", "disk") else "other"


def _grouped_keys(device_map: Mapping[str, int | str]) -> dict[Any, list[str]]:
    """Map keys per device, runs of numbered siblings folded: ``model.layers.0-5``."""
    runs: dict[Any, list[list]] = defaultdict(list)
    for key, device in device_map.items():
        prefix, _, last = key.rpartition(".")
        group = runs[device]
        if last.isdigit() and group and group[-1][0] == prefix and group[-1][2] == int(last) - 1:
            group[-1][2] = int(last)
            continue
        group.append([prefix, int(last) if last.isdigit() else None, int(last) if last.isdigit() else None, key])
    out: dict[Any, list[str]] = {}
    for device, group in runs.items():
        out[device] = [
            key if first is None or first == end else f"{prefix}.{first}-{end}" for prefix, first, end, key in group
        ]
    return out


def plan_text(
    summary: Mapping[str, Any],
    plan: Mapping[str, Any],
    predicted: int | None,
    device_map: Mapping[str, int | str] | None = None,
    per: str = "generated token",
    held_for: str = "the KV cache and activations",
) -> str:
    """The plan as printed before loading: per device its bytes, budget use and (with ``device_map``) its keys,
    the reservation held back, and the predicted bytes moved per generated token.

    ``summary`` is :func:`offload_core.planning.summarize_device_map`'s result; ``plan`` holds
    ``reserve`` (device -> bytes) and optionally ``headroom`` (bytes held back from the budget of the device that
    computes, for ``held_for``).
    """
    lines = []
    keys = _grouped_keys(device_map) if device_map is not None else {}
    keys = {str(k): v for k, v in keys.items()}
    total = summary.get("total_bytes") or sum(info["bytes"] for info in summary["devices"].values())
    for device, info in summary["devices"].items():
        budget = info.get("budget")
        used = f" of a {format_size(budget)} budget ({100 * info['fraction']:.0f}%)" if budget else ""
        share = f", {100 * info['bytes'] / total:.0f}% of the model" if total else ""
        lines.append(f"{device:>5}: {format_size(info['bytes'])}{used}{share}, {info['tensors']} tensors")
        shown = keys.get(str(device), [])
        if shown:
            listed = ", ".join(shown[:12]) + (f" and {len(shown) - 12} more" if len(shown) > 12 else "")
            lines.append(f"       {listed}")
    reserve = ", ".join(f"{k}: {format_size(v)}" for k, v in (plan.get("reserve") or {}).items())
    lines.append(f"reserved for offloaded weights in flight: {reserve or 'none'}")
    if plan.get("headroom"):
        lines.append(
            f"held back from the budget of the device that computes, for {held_for}: {format_size(plan['headroom'])}"
        )
    if predicted is not None:
        lines.append(f"predicted bytes moved per {per}: {format_size(predicted)}")
    return "\n".join(lines)


def plot_placement(
    model: nn.Module, device_map: Mapping[str, int | str], sizes: Mapping[str, int], path: str | Path
) -> Path:
    """Write a PNG of the placement: a horizontal bar per device, one segment per device-map key, coloured by tier.

    ``sizes`` is :func:`offload_core.planning.compute_module_sizes`'s result for ``model`` (bytes by name).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from offload_core.planning import normalize_device_map
    from offload_core.planning.device_map import device_order

    device_map = normalize_device_map(device_map)
    devices = sorted(set(device_map.values()), key=device_order)
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * len(devices)))
    mib = 2**20
    longest = (
        max((sum(sizes.get(k, 0) for k, w in device_map.items() if w == d) / mib for d in devices), default=0) or 1
    )
    for row, device in enumerate(devices):
        left = 0.0
        for key, where in device_map.items():
            if where != device:
                continue
            width = sizes.get(key, 0) / mib
            if width <= 0:
                continue
            ax.barh(row, width, left=left, color=TIER_COLOURS[_tier(device)], edgecolor="white", linewidth=0.8)
            if width > 0.1 * longest:
                ax.text(
                    left + width / 2,
                    row,
                    key.rpartition(".")[2] or key,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
            left += width
        ax.text(left, row, f" {left:.1f} MiB", va="center", fontsize=8)
    ax.set_yticks(range(len(devices)), [str(gpu(d)) if isinstance(d, int) else str(d) for d in devices])
    ax.invert_yaxis()
    ax.set_xlabel("MiB (one segment per device-map key)")
    tiers = sorted({_tier(d) for d in devices}, key=list(TIER_COLOURS).index)
    ax.set_xlim(0, longest * 1.15)
    ax.legend(
        handles=[Patch(color=TIER_COLOURS[t], label=t) for t in tiers],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
    )
    ax.set_title(f"placement of {type(model).__name__}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
