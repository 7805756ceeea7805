"""Tiny checkpoints quantized by transformers itself (torchao int8 and int4 weight-only, bitsandbytes 4-bit and 8-bit)
and saved with save_pretrained, as users make them; the tests skip a method whose library is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers


#: wide enough for bitsandbytes' CPU layout of 4-bit weights (blocks of 64 along a row)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)

#: method name -> (library, the quantization config's maker, the dtype the model is quantized from)
METHODS = {
    "torchao-int8": ("torchao", lambda: _torchao("Int8WeightOnlyConfig"), torch.float32),
    "torchao-int4": ("torchao", lambda: _torchao("IntxWeightOnlyConfig"), torch.float32),
    "bnb-nf4": ("bitsandbytes", lambda: _bnb(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32), torch.float32),
    "bnb-nf4-bf16": (
        "bitsandbytes",
        lambda: _bnb(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16),
        torch.bfloat16,
    ),
    "bnb-fp4": (  # fp4 codes, block scales without the second quantization
        "bitsandbytes",
        lambda: _bnb(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False),
        torch.float32,
    ),
    "bnb-int8": ("bitsandbytes", lambda: _bnb(load_in_8bit=True), torch.float32),
}


def _torchao(name: str) -> transformers.TorchAoConfig:
    import torchao.quantization as q

    if name == "IntxWeightOnlyConfig":  # torchao's int4 weight-only layout that runs on the CPU
        return transformers.TorchAoConfig(q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=q.PerGroup(32)))
    return transformers.TorchAoConfig(getattr(q, name)())


def _bnb(**kwargs) -> transformers.BitsAndBytesConfig:
    if kwargs.get("load_in_4bit"):
        kwargs = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True, **kwargs}
    return transformers.BitsAndBytesConfig(**kwargs)


def float_folder(root: Path, dtype: torch.dtype = torch.float32, config=None) -> Path:
    """A seeded tiny Llama saved in ``dtype`` under ``root`` (made once)."""
    folder = root / f"float-{str(dtype).removeprefix('torch.')}"
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        config = config or transformers.LlamaConfig(**TINY)
        transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(folder)
    return folder


def quantize(source: Path, method: str, folder: Path, **save) -> Path:
    """``source`` loaded by transformers with ``method``'s quantization config and saved into ``folder`` (``save``:
    save_pretrained's arguments)."""
    library, make, dtype = METHODS[method]
    needs(library)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, quantization_config=make(), dtype=dtype)
    model.save_pretrained(folder, **save)
    return folder


def quantized_folder(root: Path, method: str) -> Path:
    """A tiny Llama quantized with ``method`` under ``root`` (made once; skipped without its library); a method
    name ending in ``-sharded`` saves it in shards of 60 KB."""
    folder = root / method
    base = method.removesuffix("-sharded")
    if not (folder / "config.json").exists():
        save = {"max_shard_size": "60KB"} if base != method else {}
        quantize(float_folder(root, METHODS[base][2]), base, folder, **save)
    needs(METHODS[base][0])
    return folder


def needs(library: str) -> None:
    """Skip the test unless ``library`` and what transformers builds its layers with are installed."""
    from offload_core.loading.quantized import NEEDS

    for name in NEEDS.get(library, (library,)):
        pytest.importorskip(name)
