"""Checkpoints saved by transformers with a quantization config (torchao, bitsandbytes): each quantized layer holds
its packed tensors as plain tensors under the checkpoint's names, so the plan, the stores and the module-hook policies
see packed bytes, and the layer rebuilds its quantized weight from them just before its forward.

A quantized layer of transformers' own in-memory model holds one weight, a tensor subclass (torchao's ``Int8Tensor``,
``IntxUnpackedToInt8Tensor``, ...; bitsandbytes' ``Params4bit``, ``Int8Params``) made from the plain tensors the
checkpoint holds. Here the layer holds those plain tensors themselves (``_weight_qdata``, ``_weight_scale``, ...;
``weight``, ``weight.absmax``, ...), on its device or offloaded like any other tensor, and its class is swapped for a
subclass whose ``forward`` makes the weight from them as transformers' loader makes it (the same library calls), runs
the layer's own ``forward`` with it, and lets go of it: a module-hook policy has brought the plain tensors in by then.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from offload_core.errors import CheckpointError
from offload_core.planning.sizing import KEPT_DTYPES

__all__ = ["QuantizationError", "SUPPORTED", "quant_method", "check_quantization", "pack_quantized"]

#: quantization methods whose checkpoints run packed -> the library each needs (its pip name)
SUPPORTED: dict[str, str] = {"torchao": "torchao", "bitsandbytes": "bitsandbytes"}


class QuantizationError(CheckpointError):
    """A quantized checkpoint that cannot run here: an unsupported method, its library missing, a layout we cannot
    read."""


def quant_method(config: Any) -> str | None:
    """The ``quant_method`` of ``config.quantization_config`` (a dict or a transformers config object), or None."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    if isinstance(quantization, dict):
        method = quantization.get("quant_method")
    else:
        method = getattr(quantization, "quant_method", None)
    method = getattr(method, "value", method)
    return str(method) if method is not None else "unknown"


def check_quantization(config: Any, where: str | Path) -> str | None:
    """The checkpoint's quantization method when offload_core runs it packed (None for a float checkpoint); a
    :class:`QuantizationError` naming the method, and what to do, when it cannot."""
    method = quant_method(config)
    if method is None:
        return None
    if method not in SUPPORTED:
        raise QuantizationError(
            f"{where} is quantized with {method!r}, which offload_core cannot offload packed (it runs "
            f"{' and '.join(SUPPORTED)} checkpoints): use a float checkpoint of the model or one quantized with "
            "torchao or bitsandbytes"
        )
    library = SUPPORTED[method]
    missing = [name for name in NEEDS.get(library, (library,)) if importlib.util.find_spec(name) is None]
    if missing:
        raise QuantizationError(
            f"{where} is quantized with {method!r}, which needs the {' and '.join(missing)} package"
            f"{'s' if len(missing) > 1 else ''}: install {'them' if len(missing) > 1 else 'it'} "
            f"(pip install 'offload_core[quant]' or pip install {' '.join(missing)})"
        )
    return method


#: the packages transformers builds each library's layers with (its bitsandbytes quantizer also requires accelerate)
NEEDS = {"bitsandbytes": ("bitsandbytes", "accelerate"), "torchao": ("torchao",)}


@dataclass
class Packing:
    """How one layer's quantized weight is made from the plain tensors it holds."""

    weight: str  # the parameter the layer's forward reads (``weight``)
    attributes: dict[str, str]  # the layer's attribute -> the suffix of its checkpoint key (after ``<layer>.``)
    make: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]  # suffix -> tensor, to the weight
    release: Callable[[nn.Module], None] = field(default=lambda module: None)
    #: attribute -> the checkpoint's tensor, for the parts random values cannot stand for (bitsandbytes' quantization
    #: state, a few bytes of JSON): a copy with random weights, timed to predict a run, takes them
    example: dict[str, torch.Tensor] = field(default_factory=dict)
    #: whether the weight made once may serve every forward of a resident layer (it shares the layer's tensors, as
    #: the in-memory model's weight does); False where the library converts it at its first forward (bitsandbytes'
    #: 4-bit layers on a CPU with bfloat16 instructions), which would then hold it twice
    reusable: Callable[[nn.Module, torch.device], bool] = field(default=lambda module, device: True)
    #: set at dispatch: none of the layer's tensors is offloaded (:func:`settle_packed`)
    resident: bool = False
    #: the weight a resident layer made at its first forward, and keeps (as the in-memory model keeps its own)
    made: torch.Tensor | None = None


def _packed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    packing: Packing = self._offload_packing
    weight = packing.made
    if weight is None:
        parts = {suffix: getattr(self, attribute) for attribute, suffix in packing.attributes.items()}
        weight = packing.make(self, parts)
        if not isinstance(weight, nn.Parameter):  # as transformers' loader sets it
            weight = nn.Parameter(weight, requires_grad=False)
        if packing.resident and packing.reusable(self, weight.device):
            packing.made = weight
    params = self._parameters
    held = params.get(packing.weight)
    params[packing.weight] = weight
    try:
        return type(self).__mro__[2].forward(self, *args, **kwargs)
    finally:
        if held is None:
            del params[packing.weight]
        else:
            params[packing.weight] = held
        if packing.made is None:
            packing.release(self)


_CLASSES: dict[type, type] = {}


def _packed_class(cls: type) -> type:
    """``cls`` with a forward that makes its quantized weight first (one class per layer class); the state dict holds
    the plain tensors, as nn.Module writes them (bitsandbytes' layers add their quantization state to it)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"Packed{cls.__name__}",
            (_Packed, cls),
            {"forward": _packed_forward, "_save_to_state_dict": nn.Module._save_to_state_dict},
        )
    return _CLASSES[cls]


class _Packed:
    """Marks a layer whose quantized weight is made from its plain tensors at each forward."""


def _hold(module: nn.Module, name: str, packing: Packing, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> list:
    """Swap ``module``'s weight for meta plain tensors shaped as the checkpoint's; returns their model names."""
    module._parameters.pop(packing.weight, None)
    names = []
    for attribute, suffix in packing.attributes.items():
        shape, dtype = shapes[f"{name}.{suffix}"]
        module.register_parameter(attribute, nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), False))
        names.append(f"{name}.{attribute}")
    module._offload_packing = packing
    module.__class__ = _packed_class(type(module))
    return names


def _torchao_packings(model: nn.Module, checkpoint: Any) -> dict[str, Packing]:
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    metadata: dict[str, str] = {}
    for shard, _ in checkpoint.shards():
        if Path(shard).suffix != ".safetensors":
            raise QuantizationError(
                f"{checkpoint.path} holds a torchao checkpoint in {Path(shard).name}, not in safetensors files: save "
                "it with save_pretrained(..., safe_serialization=True)"
            )
        metadata.update(checkpoint.safetensors_file(shard).metadata)
    keys = checkpoint.keys()
    packings = {}
    for tensor_name, value in metadata.items():
        try:
            entry = json.loads(value)
        except (TypeError, ValueError):
            continue
        if not isinstance(entry, dict) or entry.get("_type") in (None, "Tensor"):
            continue
        layer, weight = tensor_name.rsplit(".", 1)
        prefix = f"{layer}._{weight}_"
        suffixes = [key[len(layer) + 1 :] for key in keys if key.startswith(prefix)]
        if not suffixes:
            raise QuantizationError(
                f"{checkpoint.path}: the torchao metadata names {tensor_name!r} but no tensor holds its data; "
                "re-save the checkpoint"
            )
        local = {"tensor_names": json.dumps([f"m.{weight}"]), f"m.{weight}": value}

        def make(module: nn.Module, parts: dict[str, torch.Tensor], local=local, weight=weight) -> torch.Tensor:
            made, left = unflatten_tensor_state_dict({f"m.{suffix}": t for suffix, t in parts.items()}, local)
            return made[f"m.{weight}"]

        packings[layer] = Packing(weight, {suffix: suffix for suffix in suffixes}, make)
    return packings


def _bnb_packings(model: nn.Module, checkpoint: Any) -> dict[str, Packing]:
    import bitsandbytes as bnb

    keys = set(checkpoint.keys())
    packings = {}
    for layer, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            suffixes = sorted(key[len(layer) + 1 :] for key in keys if key.startswith(f"{layer}.weight"))
            attributes = {suffix.replace(".", "__"): suffix for suffix in suffixes}

            def make(module: nn.Module, parts: dict[str, torch.Tensor]) -> torch.Tensor:
                # the quantization state's JSON as read at load, on the host: parsing a copy on a GPU would wait
                # for the device at every layer
                example = module._offload_packing.example
                stats = {
                    suffix: example.get(suffix.replace(".", "__"), t)
                    for suffix, t in parts.items()
                    if suffix != "weight"
                }
                data = parts["weight"]
                return bnb.nn.Params4bit.from_prequantized(
                    data=data, quantized_stats=stats, requires_grad=False, device=data.device, module=module
                )

            def release(module: nn.Module) -> None:
                module.quant_state = None  # from_prequantized hangs the state on the layer

            def reusable(module: nn.Module, device: torch.device) -> bool:
                return not (device.type == "cpu" and getattr(module, "support_avx512bf16_for_cpu", False))

            packings[layer] = Packing("weight", attributes, make, release, reusable=reusable)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            held = {k: v for k, v in module.weight.__dict__.items() if k not in ("CB", "SCB")}
            suffixes = [s for s in ("weight", "SCB", "weight_format") if f"{layer}.{s}" in keys]

            def make(module: nn.Module, parts: dict[str, torch.Tensor], held=held) -> torch.Tensor:
                data = parts["weight"]
                return bnb.nn.Int8Params(data, requires_grad=False, **held, SCB=parts["SCB"]).to(data.device)

            def release(module: nn.Module) -> None:
                module.state.CB = module.state.SCB = None  # the layer's state keeps what its forward read

            packings[layer] = Packing("weight", {s: s for s in suffixes}, make, release)
    return packings


def _preprocess(model: nn.Module, config: Any, dtype: torch.dtype) -> None:
    """The model's layers replaced as transformers' quantizer replaces them for a pre-quantized checkpoint."""
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True)
    quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, checkpoint_files=None)


def pack_quantized(model: nn.Module, config: Any, checkpoint_dir: str | Path, dtype: torch.dtype) -> list[str]:
    """Make ``model`` (empty, on meta) hold the packed tensors of the quantized checkpoint in ``checkpoint_dir``: its
    quantized layers' weights become the checkpoint's plain tensors (their shapes and dtypes), loaded and offloaded as
    they are (never converted to the run's dtype), made into the quantized weight at each forward. Returns the names
    of the packed tensors; nothing for a float checkpoint."""
    from offload_core.loading.checkpoint import Checkpoint

    method = check_quantization(config, checkpoint_dir)
    if method is None:
        return []
    _preprocess(model, config, dtype)
    with Checkpoint.open(checkpoint_dir) as checkpoint:
        find = _torchao_packings if method == "torchao" else _bnb_packings
        packings = find(model, checkpoint)
        shapes = {key: (torch.Size(checkpoint.shape(key)), checkpoint.dtype(key)) for key in checkpoint.keys()}
        if not packings:
            raise QuantizationError(
                f"{checkpoint_dir} declares {method!r} quantization but holds no quantized layer: re-save it with "
                "save_pretrained from the quantized model"
            )
        names: list[str] = []
        renamed: dict[str, str] = {}
        for layer, packing in packings.items():
            module = model.get_submodule(layer)
            for attribute, suffix in packing.attributes.items():
                if f"{layer}.{suffix}" not in shapes:
                    raise QuantizationError(
                        f"{checkpoint_dir} lacks {layer}.{suffix}: re-save the quantized checkpoint"
                    )
                if attribute != suffix:
                    renamed[f"{layer}.{attribute}"] = f"{layer}.{suffix}"
                if "quant_state" in suffix:
                    packing.example[attribute] = checkpoint.get(f"{layer}.{suffix}").clone()
            names.extend(_hold(module, layer, packing, shapes))
    setattr(model, KEPT_DTYPES, frozenset(names))
    model.offload_packed_renames = renamed
    return names


def random_copy(module: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A copy of a meta ``module`` on ``device`` with small random weights, floating ones in ``dtype``; a quantized
    layer's packed tensors keep their dtypes (random codes, the checkpoint's quantization state): what the plan times
    to predict a run."""
    copy_ = copy.deepcopy(module).to_empty(device=device)
    packed = {
        f"{name}.{attribute}".lstrip(".")
        for name, layer in copy_.named_modules()
        if isinstance(layer, _Packed)
        for attribute in layer._offload_packing.attributes
    }
    with torch.no_grad():
        for name, tensor in [*copy_.named_parameters(), *copy_.named_buffers()]:
            if tensor.is_floating_point() and name not in packed:
                tensor.data = tensor.data.to(dtype)
        for tensor in copy_.parameters():
            if tensor.is_floating_point():
                tensor.normal_(0, 0.02)
            else:
                tensor.random_(0, 16)
        for layer in copy_.modules():
            if isinstance(layer, _Packed):
                for attribute, value in layer._offload_packing.example.items():
                    getattr(layer, attribute).copy_(value)
    return copy_


def packed_lines(model: nn.Module, dtype: torch.dtype | None) -> list[str]:
    """The plan report's line on a quantized checkpoint's layers: how many hold their weights packed, in how many
    bytes, against the run's ``dtype``; nothing for a float model."""
    from offload_core.values import format_size

    layers = [module for module in model.modules() if isinstance(module, _Packed)]
    if not layers:
        return []
    packed = sum(
        getattr(layer, attribute).numel() * getattr(layer, attribute).element_size()
        for layer in layers
        for attribute in layer._offload_packing.attributes
    )
    width = (dtype or torch.float32).itemsize
    unpacked = sum(getattr(layer, "in_features", 0) * getattr(layer, "out_features", 0) for layer in layers) * width
    return [
        f"quantized ({quant_method(model.config)}): {len(layers)} layers hold their weights packed, "
        f"{format_size(packed)} where {str(dtype or torch.float32).removeprefix('torch.')} would take "
        f"{format_size(unpacked)}; offloaded ones move packed and run through the quantized layer"
    ]


def settle_packed(model: nn.Module, offloaded: set[str] | frozenset[str]) -> None:
    """Mark the quantized layers none of whose tensors is ``offloaded`` (model names) resident: each makes its weight
    at its first forward and keeps it, as the in-memory model does; the others make it at every forward."""
    for name, layer in model.named_modules():
        if isinstance(layer, _Packed):
            packing = layer._offload_packing
            packing.made = None
            packing.resident = not any(f"{name}.{attribute}" in offloaded for attribute in packing.attributes)
