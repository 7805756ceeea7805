"""Tiny GGUF files the tests build themselves: a seeded transformers model (of an architecture in :data:`ARCHS`) written
with gguf-py's writer, its tensors quantized by gguf-py (K-quants as random valid blocks, which gguf-py cannot
quantize), with a small byte-level tokenizer; and transformers' own in-memory model of such a file, the reference
outputs are compared with."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from tests.gguf_archs import ARCHS, HEAD_COPIED, Arch, tiny_config

__all__ = ["ARCHS", "Arch", "half_offloaded_map", "tiny_config", "transformers_model", "write_gguf"]

#: a float16 scale at these byte offsets of each block (kept small and finite in random K-quant blocks)
_SCALES = {10: [80, 82], 11: [108], 12: [0, 2], 13: [0, 2], 14: [208]}


def _bytes_to_unicode() -> dict[int, str]:
    chars = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in chars:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _random_blocks(kind: int, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    elements, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    rows = int(np.prod(shape[:-1]))
    count = rows * shape[-1] // elements
    raw = rng.integers(0, 256, size=(count, nbytes), dtype=np.uint8)
    for offset in _SCALES[kind]:
        raw[:, offset : offset + 2] = (
            (rng.standard_normal(count) * 2e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    return raw.reshape(*shape[:-1], shape[-1] // elements * nbytes)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (what its converter writes; transformers undoes it)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    path: Path,
    arch: str = "llama",
    types: dict[str, int] | None = None,
    default: int = 3,
    layers: int = 3,
    seed: int = 0,
    metadata: dict[str, int] | None = None,
    drop: tuple[str, ...] = (),
    arch_name: str | None = None,
    hidden: int = 256,
    split_tensors: int = 0,
) -> Path:
    """A GGUF file of a seeded tiny ``arch`` model (a key of :data:`ARCHS`): every weight of two or more dimensions
    of GGML type ``default`` unless ``types`` maps a part of its GGUF name (``ffn_up``, ``output.weight``) to another
    (norms and biases stay F32); ``metadata`` overrides the header's numbers (``block_count`` ...), ``drop`` leaves
    GGUF tensors out, ``arch_name`` writes another architecture name in the header, ``hidden`` sizes the model;
    ``split_tensors`` splits it across files of that many tensors each as llama.cpp's gguf-split does
    (``name-00001-of-0000N.gguf``, ...: the first part's path is returned)."""
    import gguf
    import transformers
    from gguf import GGMLQuantizationType as T
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    spec = ARCHS[arch]
    torch.manual_seed(seed)
    config = tiny_config(arch, layers, hidden)
    model = getattr(transformers, spec.model)(config).eval()
    rng = np.random.default_rng(seed)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, spec.gguf), layers)
    arch_name = arch_name or spec.header
    writer = gguf.GGUFWriter(str(path), arch_name, split_max_tensors=split_tensors)
    mapping = GGUF_CONFIG_MAPPING[spec.mapping or arch]
    numbers = {key: _config_value(config, attr) for key, attr in mapping.items() if attr}
    if arch == "lfm2":  # a count per layer, none on the convolution ones: how llama.cpp tells them apart
        kv_heads = config.num_key_value_heads
        numbers["attention.head_count_kv"] = [kv_heads * (kind != "conv") for kind in config.layer_types]
    for key, value in {**numbers, **(metadata or {})}.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch_name}.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"{arch_name}.{key}", value)
        elif isinstance(value, list):
            writer.add_array(f"{arch_name}.{key}", value)
    writer.add_name(spec.name or f"tiny {arch}")
    _add_tokenizer(writer)
    written: set[str] = set()
    for name, data in _gguf_tensors(model.state_dict(), names, config, arch):
        if name in drop or name in written:  # (a tensor several names share: once)
            continue
        written.add(name)
        kind = default if data.ndim >= 2 else int(T.F32)
        for part, chosen in (types or {}).items():
            if "." + part in "." + name and data.ndim >= 2:
                kind = chosen
        if data.shape[-1] % gguf.GGML_QUANT_SIZES[T(kind)][0]:  # rows too short for its blocks: llama.cpp's F32
            kind = int(T.F32)
        _add(writer, name, data, kind, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
    return parts[0] if split_tensors and len(parts) > 1 else path


def _config_value(config, attr: str) -> int | float | None:
    """``config``'s ``attr`` as a GGUF header holds it (the RoPE base from the rope parameters where kept there)."""
    if attr == "rope_theta" and not hasattr(config, attr):
        return float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    return getattr(config, attr, None)


def _gguf_name(names, hf_name: str) -> str:
    """``hf_name``'s GGUF name: its module's with the ``.weight`` / ``.bias`` suffix, or the whole name's for a bare
    parameter (mamba's ``A_log``); a module under the base model named as gguf-py knows it (bloom's embedding norm)."""
    base, _, suffix = hf_name.rpartition(".")
    tries = [(base, "." + suffix)] if suffix in ("weight", "bias") else []
    for key, tail in [*tries, (hf_name, "")]:
        for candidate in (key, key.partition(".")[2]):
            found = names.get_name(candidate)
            if found is not None:
                return found + tail
    raise KeyError(f"no GGUF name for {hf_name}")


def _gguf_tensors(state: dict, names, config, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """``state``'s tensors under their GGUF names, as llama.cpp's converter writes them: llama's q and k permuted, a
    fused expert tensor as one tensor per projection, the shared expert's gate as a vector, the other layouts of
    :func:`_llama_cpp_layout`."""
    for hf_name, tensor in state.items():
        data = tensor.float().numpy()
        experts = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(_bias)?", hf_name)
        if experts is not None:
            block, kind, bias = experts.groups()
            suffix = ".bias" if bias else ".weight"
            if arch == "gpt_oss" and not bias:  # (experts, in, out), gate and up interleaved: llama.cpp's (out, in)
                data = data.swapaxes(1, 2)
            if kind == "down":
                yield f"blk.{block}.ffn_down_exps{suffix}", data
            else:
                gate, up = (data[:, ::2], data[:, 1::2]) if arch == "gpt_oss" else np.split(data, 2, axis=1)
                yield f"blk.{block}.ffn_gate_exps{suffix}", gate
                yield f"blk.{block}.ffn_up_exps{suffix}", up
            continue
        if hf_name.endswith(".mlp.e_score_correction_bias"):  # minimax-m2's routing bias
            yield f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias", data
            continue
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the embedding's
        name = _gguf_name(names, hf_name)
        if name.endswith("attn_sinks"):  # gpt-oss's: llama.cpp names it a weight (transformers looks for it bare)
            name += ".weight"
        yield name, _llama_cpp_layout(arch, name, data, config)
        if name == "token_embd.weight" and arch in HEAD_COPIED:
            yield "output.weight", data


def _llama_cpp_layout(arch: str, name: str, data: np.ndarray, config) -> np.ndarray:
    """Tensor ``name`` of ``arch`` as llama.cpp's converter writes it (transformers' tensor processor undoes it)."""
    if arch in ("llama", "mistral") and ".attn_q." in name:
        return _permute(data, config.num_attention_heads)
    if arch in ("llama", "mistral") and ".attn_k." in name:
        return _permute(data, config.num_key_value_heads)
    if arch in ("gemma2", "gemma3", "nemotron") and name.endswith("norm.weight"):
        return data + 1  # transformers subtracts the one llama.cpp adds
    if name.endswith("ffn_gate_inp_shexp.weight"):
        return data.reshape(-1)
    if arch == "gpt2" and name.endswith(("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")):
        return data.T  # Conv1D's (in, out) as a linear layer's (out, in)
    if arch == "bloom" and ".attn_qkv." in name:  # q, k, v of each head in turn: all q first, then k, then v
        return data.reshape(config.n_head, 3, -1, *data.shape[1:]).swapaxes(0, 1).reshape(data.shape)
    if name.endswith(("ssm_conv1d.weight", "shortconv.conv.weight")):
        return data.squeeze(1)
    if name.endswith("ssm_a"):
        return -np.exp(data)
    return data


def _add(writer, name: str, data: np.ndarray, kind: int, rng: np.random.Generator) -> None:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    if kind == int(T.F32):
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    elif kind == int(T.F16):
        writer.add_tensor(name, data.astype(np.float16))
    elif kind in _SCALES:
        writer.add_tensor(name, _random_blocks(kind, data.shape, rng), raw_dtype=T(kind))
    else:
        writer.add_tensor(name, quantize(np.ascontiguousarray(data), T(kind)), raw_dtype=T(kind))


def _add_tokenizer(writer) -> None:
    """A byte-level BPE (gpt2) tokenizer: the 256 bytes, a few merges, and bos/eos/pad tokens."""
    chars = _bytes_to_unicode()
    tokens = [chars[b] for b in range(256)] + ["<s>", "</s>", chars[ord(" ")] + "t", "th"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 1, 1])
    writer.add_token_merges([f"{chars[ord(' ')]} t", "t h"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_pad_token_id(257)


def transformers_model(path: Path, dtype: torch.dtype | None = None):
    """transformers' in-memory model of GGUF file ``path``: ``from_pretrained(folder, gguf_file=...)`` where
    accelerate is installed; else the same steps it takes for these architectures (config from the file, the model
    built in float32, every tensor dequantized by gguf-py and converted by ``load_gguf_checkpoint``, loaded)."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=dtype)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and all("lm_head" in name for name in missing), (missing, unexpected)
    model.tie_weights()
    return model


def half_offloaded_map(layers: int = 3, arch: str | None = None) -> dict[str, str]:
    """A device map of :func:`write_gguf`'s model (of ``arch``: a llama-like one's unless given) with its first layers
    and the embedding resident, the later layers and the LM head offloaded (read from the file, or held by the
    store)."""
    if arch is None:
        return {
            "model.embed_tokens": "cpu",
            **{f"model.layers.{i}": "cpu" if i < layers // 2 else "disk" for i in range(layers)},
            "model.norm": "cpu",
            "model.rotary_emb": "cpu",
            "lm_head": "disk",
        }
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, ARCHS[arch].model)(tiny_config(arch, layers, 64))
    base = model.base_model_prefix  # ``model``, ``transformer``, ``backbone``
    stack = next(
        name for name, child in getattr(model, base).named_children() if isinstance(child, torch.nn.ModuleList)
    )
    found = {f"{base}.{name}": "cpu" for name, _ in getattr(model, base).named_children() if name != stack}
    found.update({f"{base}.{stack}.{i}": "cpu" if i < layers // 2 else "disk" for i in range(layers)})
    return {**found, **{name: "disk" for name, _ in model.named_children() if name != base}}
