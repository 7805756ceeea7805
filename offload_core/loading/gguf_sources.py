"""Where a GGUF model path leads: the file itself for a store that reads it in place (``storage=gguf``), or a float32
safetensors folder converted from it once (every other store); and its config, tokenizer and transformers' tensor
processor settings, built once by transformers from the file and kept in the cache (checksummed, rebuilt when
damaged)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from offload_core.loading.gguf_checkpoint import find_gguf

__all__ = ["gguf_meta_folder", "converted_gguf", "resolve_model_path", "processor_config"]

#: the processor settings file of a metadata folder
PROCESSOR_FILE = "gguf_processor.json"
#: the file of a metadata folder naming each GGUF tensor's model name (transformers' ``get_gguf_hf_weights_map``,
#: which takes half a minute on a 30-layer model: worked out once)
NAMES_FILE = "gguf_names.json"


def _fingerprint(gguf: Path) -> dict[str, Any]:
    """What a cache folder built from ``gguf`` is valid for: the file (every part of a split model) as it is now."""
    from offload_core.storage.gguf.split import split_paths

    files = split_paths(gguf) or [gguf]
    stats = [path.stat() for path in files if path.is_file()]
    found = {"source": "gguf", "path": str(gguf.resolve())}
    if len(files) == 1:
        found.update(size=stats[0].st_size, mtime_ns=stats[0].st_mtime_ns, inode=stats[0].st_ino)
    else:
        found["parts"] = [[stat.st_size, stat.st_mtime_ns, stat.st_ino] for stat in stats]
    return found


#: how the model cache's folders made from a GGUF file begin (its metadata's, its conversion's)
_MADE = "gguf-"


def _target(gguf: Path, kind: str) -> Path:
    from offload_core.loading.sources import cache_root

    key = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:16]
    return cache_root() / f"{_MADE}{kind}-{gguf.stem[:40]}-{key}"


def made_from_gguf(folder: Path) -> bool:
    """Whether ``folder`` is one of the model cache's folders made from a GGUF file (not a folder of the user's)."""
    from offload_core.loading.sources import cache_root

    return folder.parent == cache_root() and folder.name.startswith(_MADE)


def gguf_meta_folder(gguf: Path) -> Path:
    """A cache folder holding ``gguf``'s config, tokenizer, generation config and tensor-processor settings as
    transformers builds them from the file (``AutoConfig`` / ``AutoTokenizer`` with ``gguf_file``); built once."""
    from offload_core.loading.gguf_checkpoint import gguf_config, gguf_tokenizer, transformers_reading
    from offload_core.loading.sources import _cached_build
    from offload_core.storage.gguf.split import open_gguf

    open_gguf(gguf).close()  # a damaged file is one line before anything is written

    @_parsed_once()
    def build(out: Path) -> None:
        from transformers import GenerationConfig
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = gguf_config(gguf)
        config.save_pretrained(out)
        GenerationConfig.from_model_config(config).save_pretrained(out)
        tokenizer = gguf_tokenizer(gguf)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        with transformers_reading(gguf):
            parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
        parsed = json.loads(json.dumps(parsed, default=str))  # as it is read back
        (out / PROCESSOR_FILE).write_text(json.dumps(parsed, sort_keys=True) + "\n", encoding="utf-8")
        names = gguf_names(gguf, config, parsed)
        (out / NAMES_FILE).write_text(json.dumps(names, sort_keys=True) + "\n", encoding="utf-8")

    return _cached_build(_target(gguf, "meta"), {**_fingerprint(gguf), "kind": "meta", "names": 1}, build)


def gguf_names(gguf: Path, config: Any, parsed: dict[str, Any], model: Any = None) -> dict[str, str]:
    """``{GGUF tensor name: model name}`` as transformers' GGUF load names them (for the causal-LM model of
    ``config``, or ``model``, that model on meta; ``parsed``: the config dict its tensor processor is given)."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    from offload_core.loading.gguf_checkpoint import naming_model, tensor_processor, transformers_reading
    from offload_core.loading.gguf_match import match_tensors, reads_in_place
    from offload_core.storage.gguf.split import open_gguf

    file = open_gguf(gguf)
    try:
        model = naming_model(config) if model is None else model
        processor = tensor_processor(file.architecture, parsed)
        with transformers_reading(gguf), _parsed_once():  # as in every transformers read of the file here
            names = get_gguf_hf_weights_map(model, processor)
        # tensors that disagree with the metadata: refused before it is kept (where this reader reads them: the
        # others, gpt2's transposed ones say, are checked by transformers' own load as the file is converted)
        if reads_in_place(file.architecture, processor):
            match_tensors(gguf, file, names, model)
        return names
    finally:
        file.close()


def _check_tensors(gguf: Path, config: Any, model: Any) -> None:
    """Refuse, in one line naming them, tensors of ``gguf`` that disagree with its metadata or are missing, before
    converting it (where this reader names its tensors: the architectures it reads in place; ``model``: the model of
    ``config`` on meta)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from offload_core.loading.gguf_checkpoint import tensor_processor, transformers_reading
    from offload_core.loading.gguf_match import reads_in_place
    from offload_core.storage.gguf.split import open_gguf

    with transformers_reading(gguf):
        parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    file = open_gguf(gguf)
    file.close()  # its header (read as it opens) is all that is needed
    if reads_in_place(file.architecture, tensor_processor(file.architecture, parsed)):
        gguf_names(gguf, config, parsed, model)


@contextmanager
def _parsed_once() -> Iterator[None]:
    """gguf-py's ``GGUFReader`` and ``get_tensor_name_map`` memoized while transformers reads a GGUF file (its config,
    tokenizer, tensor names and tensors: each parses the whole file again, a model's vocabulary element by element,
    seconds for a 49k-token one) and names its tensors (``get_gguf_hf_weights_map`` builds the same read-only map
    again for every submodule: half a minute for a 30-layer model, a few milliseconds once). What they return is
    the same; the readers (read-only mappings of the file) go when the block ends."""
    import gguf

    if hasattr(gguf.GGUFReader, "cache_info"):  # within such a block already
        yield
        return
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def processor_config(meta: Path) -> dict[str, Any]:
    """The config dict transformers hands its GGUF tensor processor (saved by :func:`gguf_meta_folder`)."""
    return json.loads((meta / PROCESSOR_FILE).read_text(encoding="utf-8"))


def saved_names(meta: Path) -> dict[str, str]:
    """``{GGUF tensor name: model name}`` saved by :func:`gguf_meta_folder`."""
    return json.loads((meta / NAMES_FILE).read_text(encoding="utf-8"))


def converted_gguf(gguf: Path, target: Path | None = None) -> Path:
    """``gguf`` as a float32 sharded safetensors folder (config, tokenizer, generation config), converted once with
    transformers' own GGUF loader (every tensor dequantized by gguf-py, q/k permuted, keys renamed)."""
    from offload_core.loading.sources import _cached_build

    return _cached_build(
        target or _target(gguf, "f32"), {**_fingerprint(gguf), "kind": "float32"}, lambda tmp: convert_gguf(gguf, tmp)
    )


@_parsed_once()
def convert_gguf(gguf: Path, out: Path) -> None:
    """Write ``gguf`` into ``out`` as transformers' in-memory load holds it (float32 safetensors, config,
    tokenizer)."""
    from transformers import GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from offload_core.loading.gguf_checkpoint import gguf_config, gguf_tokenizer, transformers_reading
    from offload_core.loading.tasks import auto_class, infer_task
    from offload_core.loading.writer import write_sharded_safetensors

    config = gguf_config(gguf)
    tokenizer = gguf_tokenizer(gguf)
    with torch.device("meta"):  # the model of the file's kind: a causal LM's, T5's encoder-decoder ...
        model = auto_class(infer_task(config)).from_config(config)
    if is_split(gguf):
        state = split_state(gguf)
    else:
        _check_tensors(gguf, config, model)
        with transformers_reading(gguf):
            tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        state = {key: torch.as_tensor(value).to(torch.float32).contiguous() for key, value in tensors.items()}
        del tensors
    write_sharded_safetensors(state, out, max_shard_size=200 * 1000 * 1000)
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]  # as save_pretrained writes it: other tools read the class from it
    config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)


@_parsed_once()
def transformers_gguf_model(gguf: Path, model_class: Any, dtype: torch.dtype | None) -> Any:
    """transformers' own in-memory model of ``gguf``: ``model_class.from_pretrained(folder, gguf_file=...)`` where
    accelerate (which transformers asks for there) is installed; else the steps it takes for the architectures read
    tensor by tensor (config from the file, the model built, every tensor dequantized by gguf-py and converted by
    ``load_gguf_checkpoint``, then loaded). A split model (which transformers reads one file of) is the model it
    builds from the parts merged into one file: its tensors from :func:`split_state`."""
    import importlib.util

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from offload_core.loading.gguf_checkpoint import gguf_config, transformers_reading

    if not is_split(gguf) and importlib.util.find_spec("accelerate") is not None:
        with transformers_reading(gguf):
            return model_class.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    model = model_class.from_config(gguf_config(gguf), dtype=dtype or torch.float32)
    if is_split(gguf):
        tensors = split_state(gguf)
    else:
        with transformers_reading(gguf):
            tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model, torch_dtype=dtype)
        tensors = tensors["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model


def is_split(gguf: Path) -> bool:
    """Whether ``gguf`` is a part of a model split across files (:mod:`offload_core.storage.gguf.split`)."""
    from offload_core.storage.gguf.split import split_paths

    return split_paths(gguf) is not None


def split_state(gguf: Path) -> dict[str, torch.Tensor]:
    """A split GGUF model's tensors as transformers' load holds those of one file (float32, under the model's
    names): each dequantized and converted as its tensor processor does, by
    :class:`~offload_core.loading.gguf_checkpoint.GGUFCheckpoint` from the part it lies in."""
    from offload_core.loading.gguf_checkpoint import GGUFCheckpoint

    checkpoint = GGUFCheckpoint.open_gguf(gguf)
    try:
        return {key: checkpoint.get(key) for key in checkpoint.keys()}
    finally:
        checkpoint.close()


def resolve_model_path(path: str | os.PathLike[str], reads_gguf: bool) -> Path:
    """``path`` as the loaders take it: a GGUF file (or a folder holding one) stays the file for a store that reads
    GGUF in place (``reads_gguf``), and is converted once into a float32 safetensors folder for the others; any
    other path is itself."""
    path = Path(path).expanduser()
    gguf = find_gguf(path)
    if gguf is None:
        return path
    return gguf if reads_gguf else converted_gguf(gguf)
