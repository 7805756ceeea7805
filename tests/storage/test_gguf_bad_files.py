"""A GGUF file that cannot be read as it claims is one line naming what is wrong, before anything is written, whether
it is read in place or converted: truncated, damaged, a tensor of an unknown type, an architecture transformers cannot
map, fails to read or has no model for, one whose tensors it does not load (gpt-oss's experts), tensors that disagree
with the metadata (a shape, a missing tensor, the tensor count)."""

from __future__ import annotations

import struct

import pytest
from gguf import GGMLQuantizationType as T

import offload_core
from offload_core.errors import OffloadError
from offload_core.loading.checkpoint import Checkpoint
from tests.gguf_files import write_gguf


@pytest.fixture
def good(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    return write_gguf(tmp_path / "model.gguf", "llama", default=int(T.Q8_0), layers=2)


def _tensor_info(data: bytes, name: str) -> int:
    """Where ``name``'s type field lies in the tensor infos (after its name, dimension count and dimensions)."""
    at = data.index(name.encode()) + len(name)
    dims = struct.unpack_from("<I", data, at)[0]
    return at + 4 + 8 * dims


def _refused(path, *parts):
    for call in (
        lambda: Checkpoint.open(path),
        lambda: offload_core.from_pretrained(
            path, offload={"storage": "gguf", "headroom": 0}, max_memory={"cpu": "1MiB"}
        ),
        lambda: offload_core.from_pretrained(path, offload={"headroom": 0}, max_memory={"cpu": "1MiB"}),  # converts
    ):
        with pytest.raises(OffloadError) as error:
            call()
        message = str(error.value)
        assert "\n" not in message and all(part in message for part in parts), message
    assert not list((path.parent / "cache").glob("gguf-*"))  # nothing of it kept in the cache


def test_truncated(good):
    good.write_bytes(good.read_bytes()[: good.stat().st_size - 5000])
    _refused(good, "is truncated", "ends past the end of the file")


def test_header_cut_short(good):
    good.write_bytes(good.read_bytes()[:300])
    _refused(good, "truncated or damaged")


def test_header_cut_inside_the_tokenizers_strings(good):
    data = good.read_bytes()  # 259 tokens: skipped one length at a time, each checked
    good.write_bytes(data[: data.index(b"tokenizer.ggml.tokens") + 1000])
    _refused(good, "truncated or damaged")


def test_not_a_gguf_file(good):
    good.write_bytes(b"PK\x03\x04" + good.read_bytes()[4:])
    _refused(good, "is not a GGUF file")


def test_unknown_tensor_type(good):
    data = bytearray(good.read_bytes())
    struct.pack_into("<I", data, _tensor_info(bytes(data), "blk.0.ffn_up.weight"), 77)
    good.write_bytes(bytes(data))
    _refused(good, "type 77")


def test_tensor_count_disagreeing_with_the_header(good):
    data = bytearray(good.read_bytes())
    count = struct.unpack_from("<Q", data, 8)[0]
    struct.pack_into("<Q", data, 8, count + 3)  # declares tensors the file does not hold
    good.write_bytes(bytes(data))
    _refused(good, "truncated or damaged")


def test_architecture_transformers_cannot_map(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "odd.gguf", "llama", layers=2, arch_name="notanarch")
    _refused(path, "cannot map this GGUF file", "notanarch")


def test_a_file_transformers_fails_to_read_is_one_line_for_the_conversion_too(good, monkeypatch):
    """What transformers raises reading a file it cannot map (here: its gguf-py lacking the architecture, as it says
    of a llama file named exactly "mistral") is one line, for the store that reads in place and the one that
    converts."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    def unknown(*args, **kwargs):
        raise NotImplementedError("Unknown gguf model_type: mistral in gguf-py")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", unknown)
    _refused(good, "cannot map this GGUF file", "Unknown gguf model_type")


def test_an_architecture_transformers_has_no_model_class_for(tmp_path, monkeypatch):
    """deci (Nemotron-NAS): transformers maps its GGUF metadata but has no model of that type."""
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "deci.gguf", "deci", default=int(T.Q8_0), layers=2)
    _refused(path, "cannot map this GGUF file", "`deci`")


@pytest.mark.parametrize("hidden", [256, 128])
def test_gpt_oss_whose_experts_transformers_does_not_load_is_not_called_damaged(tmp_path, monkeypatch, hidden):
    """transformers' GGUF loader names none of gpt-oss's gate and up experts and reads its down experts unconverted
    (as llama.cpp writes them: transposed): its own model of the file would hold newly initialized experts, so the
    file is refused as an architecture transformers cannot load (experts as wide as the model: gpt-oss-20b's; or
    not, when the down experts' shape gives it away)."""
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "gpt-oss.gguf", "gpt_oss", default=int(T.Q8_0), layers=2, hidden=hidden)
    told = "ffn_gate_exps" if hidden == 256 else "ffn_down_exps"
    _refused(path, "cannot load GGUF files of architecture 'gpt-oss'", told, "original model's safetensors")


def test_a_falcon_40b_whose_grouped_attention_transformers_takes_for_falcon_7b_is_one_line(tmp_path, monkeypatch):
    """transformers builds every falcon GGUF's model as falcon-7b's (one key and value head): a Falcon-40B file's
    q/k/v disagrees with it, which may be that and not damage."""
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "falcon-40b.gguf", "falcon_40b", default=int(T.Q8_0), layers=2)
    _refused(path, "blk.0.attn_qkv.weight", "[512, 256]", "a variant of 'falcon' whose config transformers does not")


def test_shape_disagreeing_with_the_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "wide.gguf", "llama", layers=2, metadata={"feed_forward_length": 384})
    _refused(path, "blk.0.ffn_gate.weight", "[384, 256]", "metadata")


def test_a_tensor_missing_for_the_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "short.gguf", "llama", layers=2, drop=("blk.1.ffn_up.weight",))
    _refused(path, "needs 1 more", "model.layers.1.mlp.up_proj.weight")


def test_a_checkpoint_that_is_not_gguf_with_storage_gguf(tmp_path):
    from offload_core.loading.sources import synthetic_checkpoint

    folder = synthetic_checkpoint(tmp_path / "synthetic", num_hidden_layers=2)
    with pytest.raises(OffloadError, match="storage=gguf reads offloaded tensors in place from a GGUF file"):
        offload_core.from_pretrained(folder, offload={"storage": "gguf", "headroom": 0}, max_memory={"cpu": "100KiB"})
