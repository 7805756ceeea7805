"""The lossless bf16 code: every bit pattern decodes to itself (NaN, Inf, subnormals, -0.0, more than 15 distinct
high bytes, odd and multi-chunk sizes), on the host and through fixed scratch buffers; what it keeps raw; damage
found on read."""

from __future__ import annotations

import pytest
import torch

from offload_core.errors import StorageError
from offload_core.storage import codec

#: every bf16 bit pattern: NaNs, both infinities, subnormals, -0.0 and all 256 high bytes
EVERY_PATTERN = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def weights(n: int, seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def roundtrip(t: torch.Tensor, chunk: int) -> codec.Packed:
    packed = codec.encode(t, chunk)
    assert packed is not None
    assert torch.equal(bits(codec.decode(packed)), bits(t))
    out = torch.full_like(t, float("nan"))
    codec.decode_into(packed, out, codec.Scratch(torch.device("cpu"), chunk))
    assert torch.equal(bits(out), bits(t))
    return packed


@pytest.mark.parametrize("n", [4096, 4097, 8191, 8192, 3 * 4096 + 1, 50_001])
def test_random_weights_round_trip_at_every_size(n):
    packed = roundtrip(weights(n, seed=n), chunk=4096)
    assert len(packed.chunks) == -(-n // 4096)
    assert packed.nbytes < 2 * n


def test_weights_pack_to_about_three_quarters():
    t = weights(2**20).view(1024, 1024)
    packed = roundtrip(t, chunk=2**18)
    assert 0.74 < packed.nbytes / (2 * t.numel()) < 0.76
    assert codec.decode(packed).shape == (1024, 1024)
    assert abs(codec.estimate(t) - packed.nbytes / (2 * t.numel())) < 0.01


def test_every_bit_pattern_among_weights_round_trips():
    """More than 15 distinct high bytes: the rare ones are exceptions, at chunk edges and in the middle."""
    rare = EVERY_PATTERN[torch.randperm(65536, generator=torch.Generator().manual_seed(1))[:2000]]
    t = weights(200_000)
    t[0], t[-1], t[4095], t[4096] = float("nan"), float("-inf"), -0.0, float("inf")
    t[torch.arange(10, 200_000, 100)] = rare
    packed = roundtrip(t, chunk=4096)
    assert sum(c.exceptions for c in packed.chunks) > 1000
    assert torch.equal(bits(codec.decode(packed)), bits(t))


def test_nan_payloads_subnormals_and_negative_zero_keep_their_bits():
    special = torch.tensor([0x7FC1, 0x7F81, -1, 0x0001, 0x007F, -32768, -32767, 0x7F80, -128], dtype=torch.int16)
    t = weights(8192)
    t[::7][: special.numel()] = special.view(torch.bfloat16)
    roundtrip(t, chunk=8192)


def test_what_stays_raw():
    assert codec.encode(EVERY_PATTERN) is None  # uniform high bytes: the code would not be smaller
    assert codec.encode(weights(codec.MIN_ELEMENTS - 1)) is None  # tiny
    assert codec.encode(weights(0)) is None
    assert codec.encode(weights(10_000).to(torch.float16)) is None  # fp16: the exponent is not a byte
    assert codec.encode(weights(10_000).float()) is None
    assert codec.encode(torch.zeros(10_000, dtype=torch.bfloat16)) is not None  # one value: all indices


def test_the_code_is_deterministic():
    t = weights(30_000)
    assert torch.equal(codec.encode(t, 4096).blob, codec.encode(t.clone(), 4096).blob)


def test_a_scratch_smaller_than_the_chunks_is_refused():
    packed = codec.encode(weights(10_000), chunk=8192)
    with pytest.raises(ValueError, match="exceeds the scratch"):
        codec.decode_into(packed, torch.empty(10_000, dtype=torch.bfloat16), codec.Scratch(torch.device("cpu"), 4096))
    assert codec.scratch_bytes(4096) == codec.Scratch(torch.device("cpu"), 4096).nbytes


def test_damaged_bytes_are_found_on_read():
    t = weights(20_000)
    packed = codec.encode(t, chunk=8192)
    chunk = packed.chunks[1]
    packed.blob[chunk.offset + codec.HEADER + codec.TABLE + 100] ^= 1  # one low byte
    with pytest.raises(StorageError, match="damaged .*chunk at element 8192 fails its checksum"):
        codec.decode(packed, "w")
    with pytest.raises(StorageError, match="damaged"):
        packed.verify("w")


def test_a_damaged_header_is_found_by_device_decoding_too():
    packed = codec.encode(weights(20_000), chunk=8192)
    packed.blob[packed.chunks[2].offset + 4] ^= 1  # the element count
    out = torch.empty(20_000, dtype=torch.bfloat16)
    with pytest.raises(StorageError, match="'w'.*wrong header"):
        codec.decode_into(packed, out, codec.Scratch(torch.device("cpu"), 8192), "w")


def test_decoding_into_a_buffer_of_another_size_is_refused():
    packed = codec.encode(weights(10_000))
    with pytest.raises(ValueError, match="does not hold"):
        codec.decode_into(packed, torch.empty(9_999, dtype=torch.bfloat16))
