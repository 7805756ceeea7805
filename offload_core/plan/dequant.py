"""The time ``storage=gguf`` spends dequantizing offloaded tensors: this machine's rate per GGML type
(:mod:`offload_core.storage.gguf.rates`, measured once per type and thread count, cached in ``calibration.json`` under
``dequant``; an entry missing or damaged is measured again, ``calibrate=true`` measures every one again) and the
seconds per generated token the plan's offloaded tensors take (:func:`dequant_seconds`)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from offload_core.storage.gguf.rates import CONVERT, RATE_KEYS

#: the calibration file's section holding the rates
SECTION = "dequant"
#: the version of the kernels and of the rule timing them (:mod:`offload_core.storage.gguf.rates`) in the rates'
#: key: rates measured with earlier kernels, or by an earlier rule, are measured again
KERNELS = "k3"


def rates_key() -> str:
    """The rates' key: the host dequantizes (on a GPU run too, before the copy), with the run's thread count."""
    return f"cpu|{torch.get_num_threads()}|{KERNELS}"


def valid_rate(value: Any) -> bool:
    """A finite, positive number of bytes per second."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def valid_entry(name: str, entry: Any) -> bool:
    """Whether a cached entry is whole: a type's :data:`RATE_KEYS`, or the processor pass's one rate."""
    if name == CONVERT:
        return valid_rate(entry)
    return isinstance(entry, dict) and all(valid_rate(entry.get(key)) for key in RATE_KEYS)


def measure(name: str) -> Any:
    """Measure ``name``'s entry now (a GGML type name, or :data:`CONVERT`)."""
    from gguf import GGMLQuantizationType

    from offload_core.storage.gguf.rates import convert_rate, type_rates

    if name == CONVERT:
        return convert_rate()
    return type_rates(int(GGMLQuantizationType[name]))


def dequant_rates(types: Iterable[str], refresh: bool = False) -> dict[str, Any]:
    """This machine's rates for the GGML ``types`` named (and the processor pass): read from the calibration file
    where whole, measured where missing or damaged (and every one with ``refresh``), written back whole unless the
    machine is busy (:mod:`.busy`: then used for this run only)."""
    from offload_core.plan.busy import busy_notice
    from offload_core.plan.calibrate import _measuring, _read_cached, _write_cached

    data = _read_cached()
    section = data.get(SECTION)
    if not isinstance(section, dict):
        section = data[SECTION] = {}
    held = section.get(rates_key())
    if not isinstance(held, dict):
        held = section[rates_key()] = {}
    changed = False
    for name in sorted(set(types)) + [CONVERT]:
        if refresh or not valid_entry(name, held.get(name)):
            _measuring()
            try:
                held[name] = measure(name)
            except Exception as exc:  # noqa: BLE001 - any type gguf-py reads: its time is left out, the run goes on
                held.pop(name, None)
                print(f"  no dequantization rate for {name} ({type(exc).__name__}: {exc}); its time is left out")
                continue
            changed = True
    if changed and busy_notice() is None:
        _write_cached(data)
    return held


def dequant_seconds(rows: list[dict[str, Any]], rates: dict[str, Any], held_buffers: bool) -> float:
    """Seconds per generated token dequantizing the plan's offloaded tensors (``rows``: :attr:`Plan.dequant`), each
    row's ``predicted_s`` set: its float32 bytes at its type's rate into the buffers a policy holds
    (``held_buffers``) or else into new tensors, and a converted tensor's processor pass on top (it is dequantized
    into a buffer held for it first). A row whose rate could not be measured is left out."""
    total = 0.0
    for row in rows:
        rate = rates.get(row["type"])
        nbytes = row["dequant_bytes"]
        if rate is None or (row["converted"] and CONVERT not in rates):
            row.pop("predicted_s", None)  # a rate that could not be measured: said in the plan's lines
            continue
        if row["converted"]:
            seconds = nbytes / rate["into_bps"] + nbytes / rates[CONVERT]  # into a held buffer, then un-permuted
        else:
            seconds = nbytes / rate["into_bps" if held_buffers else "fresh_bps"]
        row["predicted_s"] = seconds
        total += seconds
    return total


def dequant_lines(rows: list[dict[str, Any]], per: str = "generated token") -> list[str]:
    """Per GGML type of the offloaded tensors: quantized bytes read in place, float32 bytes dequantized and the
    predicted dequantization time per ``per``."""
    from offload_core.values import format_size

    if not rows:
        return []
    lines = [f"dequantized per {per}, by GGML type (read in place -> dequantized, predicted time):"]
    for row in rows:
        seconds = row.get("predicted_s")
        time_ = f"{seconds * 1e3:.1f} ms" if seconds is not None else "not predicted"
        if row.get("on_device"):
            time_ = "on the device"
        extra = ", with transformers' processor pass" if row["converted"] else ""
        lines.append(
            f"  {row['type']} x{row['tensors']}{extra}: {format_size(row['read_bytes'])} -> "
            f"{format_size(row['dequant_bytes'])}, {time_}"
        )
    total = sum(row.get("predicted_s", 0.0) for row in rows)
    lines.append(
        f"  in all: {format_size(sum(r['read_bytes'] for r in rows))} -> "
        f"{format_size(sum(r['dequant_bytes'] for r in rows))}, {total * 1e3:.1f} ms"
    )
    return lines
