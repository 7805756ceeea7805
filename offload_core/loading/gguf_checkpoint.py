"""A GGUF file as a checkpoint under transformers' names: its config and tokenizer as transformers builds them, each
tensor dequantized and converted (q/k permutation, ...) exactly as ``from_pretrained(gguf_file=...)`` does, and its
quantized blocks handed to the store that reads them in place (``storage=gguf``)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from offload_core.errors import CheckpointError, ConfigError, OffloadError
from offload_core.loading.checkpoint import Checkpoint
from offload_core.loading.gguf_match import check_in_place, match_tensors
from offload_core.storage.gguf.dequant import copy_inline, dequantize_into, held_buffer, unpermute_into
from offload_core.storage.gguf.file import GGUFFile
from offload_core.storage.gguf.split import GGUFSplit, open_gguf, split_paths

__all__ = ["GGUFCheckpoint", "find_gguf", "gguf_config", "gguf_tokenizer"]


def find_gguf(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file ``path`` names: itself when it is a ``.gguf`` file or any file that opens as one (Ollama keeps
    its models as ``blobs/sha256-…``; the first part of a split model for any of its parts), the one ``.gguf`` (or
    split model) of a folder without Hugging Face weights (a ``config.json`` beside it, as some GGUF repos hold, is
    not read: the file's metadata is its config; nor is a vision projector, ``mmproj…``); None otherwise. A folder
    holding several is a one-line error naming them."""
    path = Path(path).expanduser()
    if path.is_file():
        return _first_part(path) if path.suffix.lower() == ".gguf" or _opens_as_gguf(path) else None
    if not path.is_dir() or (path / "model_index.json").is_file():
        return None
    if any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin")):
        return None
    from offload_core.loading.hub_gguf import is_projector

    files = [p for p in path.iterdir() if p.suffix.lower() == ".gguf" and not is_projector(p.name) and p.is_file()]
    found = sorted({_first_part(p) for p in files})
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise ConfigError(f"{path} holds {len(found)} GGUF files ({names}); give the path of the one to run")
    return found[0] if found else None


def _opens_as_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False


def _first_part(path: Path) -> Path:
    parts = split_paths(path)
    return path if parts is None else parts[0]


def _architecture_error(path: Path, error: Exception) -> CheckpointError:
    import transformers

    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    return CheckpointError(
        f"{path}: transformers {transformers.__version__} cannot map this GGUF file ({reason}); use a GGUF of an "
        "architecture transformers loads (llama, qwen2, qwen3, ...) or upgrade transformers"
    )


@contextmanager
def transformers_reading(path: Path) -> Iterator[None]:
    """transformers reading GGUF file ``path``: what it raises for a file it cannot map (an architecture its gguf-py
    lacks, a tensor it cannot name) becomes one line naming the file."""
    try:
        yield
    except OffloadError:
        raise
    except (ValueError, KeyError, NotImplementedError, OSError) as error:
        raise _architecture_error(path, error) from None


def gguf_config(path: Path) -> Any:
    """The transformers config of GGUF file ``path``, as ``AutoConfig.from_pretrained(folder, gguf_file=...)``
    builds it; one line when the file is damaged or its architecture unknown to transformers."""
    from transformers import AutoConfig

    file = open_gguf(path)  # its header checked first: a damaged file is named as such
    file.close()
    for key in (f"{file.architecture}.{count}" for count in _COUNTS):
        if isinstance(file.field(key), int) and file.field(key) < 1:
            raise _no_config(path, f"{key} is {file.field(key)}")
    try:
        with transformers_reading(path):
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except _refused() as error:  # numbers the config's own checks refuse
        raise _no_config(path, str(error).strip().splitlines()[-1].strip()) from None
    # a split model: transformers ties the LM head to the embedding when the first part holds no head of its own
    if isinstance(file, GGUFSplit) and file.architecture not in ("falcon", "bloom"):  # (these two: always)
        config.tie_word_embeddings = "output.weight" not in file.entries
    return config


#: numbers of a GGUF header (after its architecture's name) that a model cannot have fewer than one of
_COUNTS = ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv")


def _refused() -> tuple[type[Exception], ...]:
    """What building a config from numbers it cannot take raises: a division by zero, or huggingface_hub's strict
    dataclass check (where this huggingface_hub has one)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return (ArithmeticError,)
    return (ArithmeticError, StrictDataclassError)


def _no_config(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: its metadata makes no model transformers can build ({why}); the file is damaged or was written for "
        "another configuration: re-download or re-convert it"
    )


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer transformers builds from GGUF file ``path`` (None when the file carries none)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (ValueError, KeyError, NotImplementedError, OSError) as error:
        if "tokenizer" in str(error).lower() or isinstance(error, KeyError):
            return None
        raise _architecture_error(path, error) from None


def read_meta_config(meta: Path) -> Any:
    """The config saved in a GGUF file's metadata folder (see :mod:`offload_core.loading.gguf_sources`)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(meta), local_files_only=True)


def tensor_processor(architecture: str, parsed: dict[str, Any]) -> Any:
    """transformers' tensor processor for a GGUF file of ``architecture`` (``parsed``: the config dict it reads)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed)


def naming_model(config: Any) -> Any:
    """The causal-LM model of ``config`` on meta (what ``from_pretrained`` names the GGUF tensors after)."""
    from offload_core.loading.empty import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM

    with init_empty_weights():
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:
            return AutoModel.from_config(config)


class GGUFCheckpoint(Checkpoint):
    """A GGUF file read as a checkpoint of float32 tensors under the model's names (what transformers' in-memory
    load holds); :meth:`read_into` dequantizes one into a buffer, and :meth:`stored_nbytes` says its bytes in the
    file. Build one with :meth:`open_gguf`."""

    is_gguf = True

    def __init__(
        self,
        path: Path,
        file: GGUFFile | GGUFSplit,
        sources: dict[str, str],
        shapes: dict[str, tuple],
        processor: Any,
        merged: dict[str, tuple[str, ...]] | None = None,
    ):
        super().__init__(path, path.parent, [path], {name: path for name in sources}, None, False)
        self.file = file
        self.sources = sources  # model name -> GGUF tensor name (the first part of a merged one)
        self._shapes = shapes
        self.processor = processor
        #: model name -> the GGUF tensors it concatenates along dimension 1, per expert (a fused expert tensor's gate
        #: and up projections, as transformers' MoE processor merges them)
        self.merged = merged or {}

    @classmethod
    def open_gguf(cls, path: str | os.PathLike[str]) -> GGUFCheckpoint:
        from offload_core.loading.gguf_sources import gguf_meta_folder, processor_config, saved_names

        path = Path(path).expanduser()
        file = open_gguf(path)
        try:
            meta = gguf_meta_folder(path)
            config = read_meta_config(meta)
            processor = tensor_processor(file.architecture, processor_config(meta))
            model = naming_model(config)
            mapping = saved_names(meta)
            check_in_place(path, file.architecture, processor, isinstance(file, GGUFSplit))
            sources, shapes, merged = match_tensors(path, file, mapping, model)
        except BaseException:
            file.close()
            raise
        return cls(path, file, sources, shapes, processor, merged)

    # -- what the loaders read --------------------------------------------------------------------
    def shards(self) -> list[tuple[Path, list[str]]]:
        order = {name: i for i, name in enumerate(self.file.entries)}
        return [(self.path, sorted(self.sources, key=lambda name: order[self.sources[name]]))]

    def dtype(self, key: str) -> torch.dtype:
        self.file_of(key)
        return torch.float32

    def shape(self, key: str) -> tuple[int, ...]:
        self.file_of(key)
        return self._shapes[key]

    def nbytes(self, key: str) -> int:
        return 4 * int(np.prod(self.shape(key), dtype=np.int64))

    def gguf_parts(self, key: str) -> tuple[str, ...]:
        """The GGUF tensors ``key`` is read from: itself, or the parts of a merged one."""
        return self.merged.get(key) or (self.sources[key],)

    def stored_nbytes(self, key: str) -> int:
        """The bytes of ``key``'s quantized blocks in the file (what reading it in place moves)."""
        return sum(self.file.entries[part].nbytes for part in self.gguf_parts(key))

    def tensor_type(self, key: str) -> str:
        """``key``'s GGML type in the file (``Q4_1``; a merged tensor's first part's)."""
        return self.file.entries[self.sources[key]].type_name

    def ggml_type(self, key: str) -> int:
        """``key``'s GGML type number in the file."""
        return int(self.file.entries[self.sources[key]].kind)

    def computes_quantized(self, key: str) -> bool:
        """Whether ``key`` is a packed tensor a linear layer computes on (``storage.compute=quantized``: see
        :mod:`offload_core.loading.gguf_qcompute`); never here."""
        return False

    def raw(self, key: str) -> torch.Tensor:
        """``key``'s quantized blocks: a uint8 view of the mapped file (a merged tensor's first part's: see
        :meth:`blocks`)."""
        return self.file.raw(self.sources[key])

    def blocks(self, key: str) -> list[torch.Tensor]:
        """The quantized blocks of each of ``key``'s parts (one for all but a merged tensor): views of the mapped
        file."""
        return [self.file.raw(part) for part in self.gguf_parts(key)]

    def byte_ranges(self, key: str) -> tuple[tuple[Path, int, int], ...]:
        """Where the blocks of each of ``key``'s parts lie: the file (a split model's part) and the bytes in it."""
        entries = [self.file.entries[part] for part in self.gguf_parts(key)]
        return tuple((self.file.file_of(e.name), e.offset, e.offset + e.nbytes) for e in entries)

    def converted_in_place(self, key: str) -> bool:
        """Whether ``key`` is its dequantized blocks as they lie: transformers' processor leaves it as it is (every
        tensor of an architecture without a processor; all but q and k for llama's, which permutes those two).
        Other processors' tensors go through the processor's own numpy code."""
        kind = type(self.processor).__name__
        if kind in ("TensorProcessor", "Qwen2MoeTensorProcessor", "MiniMaxM2TensorProcessor"):
            return key not in self.merged  # (the MoE ones merge experts', and reshape a vector the view reshapes)
        name = self.sources[key]
        return kind == "LlamaTensorProcessor" and ".attn_q." not in name and ".attn_k." not in name

    def fills(self, key: str) -> bool:
        """Whether :meth:`read_into` writes ``key`` into a float32 buffer with nothing of its size beside it: its
        blocks dequantized as they lie (llama's q and k go through a buffer the thread keeps, another processor's
        tensors through its numpy code), so that loading reads it into the memory that holds it."""
        return self.converted_in_place(key) or key in self.merged

    def read_into(self, key: str, out: torch.Tensor, held: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Dequantize ``key`` into ``out`` (its shape, any floating dtype) as transformers' load computes it (``held``:
        the quantized blocks of each of its parts, as :meth:`blocks` lists them, where held elsewhere than the mapped
        file)."""
        if key in self.merged:
            for expert in range(out.shape[0]):
                self.read_expert_into(key, expert, out[expert], held)
            return out
        entry = self.file.entries[self.sources[key]]
        raw = self.file.raw(entry.name) if held is None else held[0]
        if out.dtype == torch.float32 and out.is_contiguous():
            if self.converted_in_place(key):
                return dequantize_into(raw, entry.kind, out)
            heads = self.permuted_heads(key)
            if heads is not None:  # llama's q and k: dequantized into a held buffer, then un-permuted into ``out``
                values = dequantize_into(raw, entry.kind, held_buffer(out.numel(), out.device))
                return unpermute_into(values, heads, out)
        return copy_inline(out, self._converted(key, entry, raw))

    def reads_experts(self, key: str) -> bool:
        """Whether one expert of ``key`` (a fused expert tensor: experts first) is read by itself from its blocks
        (:meth:`read_expert_into`): a merged tensor, or a 3-D one converted as it lies."""
        return key in self.merged or (len(self.shape(key)) == 3 and self.converted_in_place(key))

    def expert_parts(self, key: str) -> list[tuple[int, int, int]]:
        """``(GGML type, rows, columns)`` of one expert in each of ``key``'s parts (see :meth:`reads_experts`)."""
        return [(int(e.kind), *e.shape[1:]) for e in (self.file.entries[part] for part in self.gguf_parts(key))]

    def expert_blocks(self, key: str, expert: int, held: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The quantized blocks of expert ``expert`` in each of ``key``'s parts (``held``: as :meth:`read_into`)."""
        experts = self.shape(key)[0]
        return [blocks.reshape(experts, -1)[expert] for blocks in (self.blocks(key) if held is None else held)]

    def read_expert_into(
        self, key: str, expert: int, out: torch.Tensor, held: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Dequantize expert ``expert`` of ``key`` (see :meth:`reads_experts`) into ``out`` (its shape without the
        experts' dimension, any floating dtype), reading only that expert's blocks; a merged tensor's parts one
        after another along its first dimension, as transformers' processor concatenates them."""
        target = out if out.dtype == torch.float32 and out.is_contiguous() else held_buffer(out.numel(), out.device)
        target = target.view(out.shape)
        start = 0
        for part, blocks in zip(self.gguf_parts(key), self.expert_blocks(key, expert, held), strict=True):
            rows = self.file.entries[part].shape[1]
            dequantize_into(blocks, self.file.entries[part].kind, target[start : start + rows])
            start += rows
        return out if target is out else copy_inline(out, target)

    def permuted_heads(self, key: str) -> int | None:
        """The head count llama's processor un-permutes ``key`` by (its q or k), as
        ``LlamaTensorProcessor.process`` takes it from the config; None where the processor leaves it as it is or
        is another one."""
        if type(self.processor).__name__ != "LlamaTensorProcessor":
            return None
        name, config = self.sources[key], self.processor.config
        heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
        if heads is None or kv_heads is None or (".attn_q." not in name and ".attn_k." not in name):
            return None
        return heads if ".attn_q." in name else kv_heads

    def get(self, key: str) -> torch.Tensor:
        """``key`` dequantized and converted (a new float32 tensor)."""
        if key in self.merged:
            return self.read_into(key, torch.empty(self._shapes[key], dtype=torch.float32))
        entry = self.file.entries[self.sources[key]]
        return self._converted(key, entry, self.file.raw(entry.name))

    def _converted(self, key: str, entry: Any, raw: torch.Tensor) -> torch.Tensor:
        """``key`` dequantized and passed through transformers' tensor processor (its numpy code, as loading does)."""
        values = dequantize_into(raw, entry.kind, torch.empty(entry.shape, dtype=torch.float32))
        if self.converted_in_place(key):
            return values.view(self._shapes[key])
        result = self.processor.process(weights=values.numpy(), name=entry.name)
        return torch.from_numpy(np.ascontiguousarray(result.weights)).view(self._shapes[key])

    def close(self) -> None:
        super().close()
        self.file.close()

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, {self.file.architecture}, {len(self.sources)} tensors)"
