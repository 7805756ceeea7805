"""The torch dequantization kernels against gguf-py's ``gguf.quants.dequantize``, bit for bit, on random blocks of
every type (built by gguf-py's quantizer where it has one), written into the caller's buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from offload_core.storage.gguf.dequant import UnsupportedTensorType, block_shape, check_supported, dequantize_into
from tests.gguf_files import _SCALES, _random_blocks

QUANTIZED_BY_GGUF = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16, T.F16, T.F32]
RANDOM_BLOCKS = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K]


def _bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).reshape(-1).view(np.int32)


def _check(raw: np.ndarray, kind: T) -> None:
    want = dequantize(raw, kind)
    out = torch.full((want.size,), float("nan"))
    pointer = out.data_ptr()
    returned = dequantize_into(torch.from_numpy(np.ascontiguousarray(raw)), int(kind), out)
    assert returned is out and out.data_ptr() == pointer  # written where the caller holds it
    assert np.array_equal(_bits(out.numpy()), _bits(want)), kind.name


@pytest.mark.parametrize("kind", QUANTIZED_BY_GGUF, ids=lambda k: k.name)
def test_quantized_by_gguf_py(kind):
    rng = np.random.default_rng(int(kind))
    data = (rng.standard_normal((70, 256)) * rng.uniform(0.01, 3.0, size=(70, 1))).astype(np.float32)
    data[3] = 0.0  # a block of zeros: scale 0
    data[5, :32] = 7.5  # a constant block
    raw = quantize(data, kind)
    if kind in (T.F16, T.F32):
        raw = raw.view(np.uint8)
    _check(raw, kind)


@pytest.mark.parametrize("kind", RANDOM_BLOCKS, ids=lambda k: k.name)
def test_k_quants_on_random_blocks(kind):
    rng = np.random.default_rng(int(kind))
    raw = _random_blocks(int(kind), (40, 1024), rng)
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[kind][1])
    for offset in _SCALES[int(kind)]:  # large scales too, not only the small ones the model files use
        large = (rng.standard_normal(blocks[::3].shape[0]) * 100).astype(np.float16)
        blocks[::3, offset : offset + 2] = large.view(np.uint8).reshape(-1, 2)
    _check(raw, kind)


def test_a_type_through_gguf_py_numpy():
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(64, 18), dtype=np.uint8)  # IQ4_NL: dequantized by gguf-py's numpy code
    raw[:, :2] = (rng.standard_normal((64, 1)) * 1e-2).astype(np.float16).view(np.uint8)
    _check(raw, T.IQ4_NL)


def test_chunks_and_odd_block_counts():
    rng = np.random.default_rng(2)
    data = rng.standard_normal((3, 32 * 1500 + 32)).astype(np.float32)  # more blocks than one pass takes
    _check(quantize(data, T.Q4_1), T.Q4_1)


def test_a_buffer_of_the_wrong_size_is_refused():
    raw = torch.zeros(34 * 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not hold"):
        dequantize_into(raw, int(T.Q8_0), torch.empty(100))


def test_unknown_and_unreadable_types_are_one_line_naming_the_type():
    with pytest.raises(UnsupportedTensorType, match="type 99 is unknown"):
        block_shape(99)
    with pytest.raises(UnsupportedTensorType, match="'blk.0.x' has type I32") as error:
        check_supported(int(T.I32), "blk.0.x")
    assert "\n" not in str(error.value)


def test_threads_dequantizing_at_once_keep_their_own_scratch():
    """A reader thread dequantizes beside the compute thread: each thread's held buffers are its own, so both give
    gguf-py's bits."""
    import threading

    rng = np.random.default_rng(3)
    raws = {kind: quantize(rng.standard_normal((64, 1024)).astype(np.float32), kind) for kind in (T.Q4_0, T.Q4_1)}
    raws[T.Q6_K] = _random_blocks(int(T.Q6_K), (64, 1024), rng)
    wrong = []

    def work():
        for _ in range(10):
            for kind, raw in raws.items():
                out = dequantize_into(torch.from_numpy(raw), int(kind), torch.empty(raw.shape[0] * 1024))
                if not np.array_equal(_bits(out.numpy()), _bits(dequantize(raw, kind))):
                    wrong.append(kind.name)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for thread in threads:
        thread.start()
    work()
    for thread in threads:
        thread.join()
    assert not wrong
