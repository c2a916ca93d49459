"""Chunk codecs: every codec round-trips every dtype bit-exactly; byte planes shrink
floats (bf16 included); broken framing is refused; a delta cannot decode without its
base; the lossy archive encodings hold exactly the rounded values their address names."""

import hashlib

import numpy as np
import pytest
import torch

from ckptflow import CorruptChunkError
from ckptflow.chunks import codecs
from ckptflow.chunks.lossy import quantize_q8
from support.states import DTYPES


def _blob(parts) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


def _tensor(dtype: torch.dtype, n: int = 5001, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen) * 0.05
    if dtype == torch.bool:
        return values > 0
    if dtype.is_floating_point or dtype.is_complex:
        return values.to(dtype)
    return (values * 2000).to(dtype)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _decode_fed(blob, base=None, *, expected: int) -> bytes:
    """``blob`` decoded into a buffer of its own while a consumer is fed; both must agree."""
    fed: list[bytes] = []
    out = bytearray(expected)
    raw = codecs.decode(blob, base, expected=expected, out=memoryview(out), consume=lambda p: fed.append(bytes(p)))
    assert bytes(raw) == bytes(out) == b"".join(fed), "the consumer was not handed exactly the decoded bytes, in order"
    return bytes(out)


def _weights(n=4096) -> bytes:
    rng = np.random.default_rng(0)
    return (rng.standard_normal(n).astype(np.float32) * 0.02).tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n", [0, 1, 3, 5001])
def test_every_codec_round_trips_every_dtype_bit_exactly(dtype, n):
    t = _tensor(dtype, n)
    raw, floating = _raw(t), dtype.is_floating_point
    for codec in ("raw", "zstd"):
        blob = _blob(codecs.encode(raw, codec, t.element_size(), floating=floating))
        assert codecs.header_codec(blob) == codec
        assert bytes(codecs.decode(blob, expected=len(raw))) == raw
        assert _decode_fed(blob, expected=len(raw)) == raw
    base = _raw(_tensor(dtype, n, seed=1))
    digest = hashlib.sha256(base).hexdigest()
    blob = _blob(codecs.encode_delta(raw, base, digest, t.element_size(), floating=floating))
    assert codecs.header_codec(blob) == "delta" and codecs.delta_base(blob) == digest
    for stored in ("raw", "zstd"):  # XORed back plane by plane (zstd base) or on the bytes (raw base)
        base_blob = _blob(codecs.encode(base, stored, t.element_size(), floating=floating))
        asked: list = []

        def base_reader(d, size, asked=asked, base_blob=base_blob):
            asked.append((d, size))
            return base_blob

        assert bytes(codecs.decode(blob, base_reader, expected=len(raw))) == raw
        assert asked == [(digest, len(raw))]
        assert _decode_fed(blob, base_reader, expected=len(raw)) == raw


def test_byte_planes_shrink_float_weights_and_bf16_to_two_thirds():
    data = _weights(1 << 16)
    plain = len(_blob(codecs.encode(data, "zstd", 1)))
    grouped = len(_blob(codecs.encode(data, "zstd", 4, floating=True)))
    assert grouped < plain < len(data) + 64
    assert grouped < 0.9 * len(data)
    bf16 = _raw(torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy()).bfloat16())
    assert len(_blob(codecs.encode(bf16, "zstd", 2, floating=True))) < 0.72 * len(bf16)


def test_a_delta_of_a_small_change_is_far_smaller_than_plain():
    old = np.frombuffer(_weights(1 << 16), dtype=np.float32)
    new = (old + np.float32(1e-5) * np.sign(old)).astype(np.float32)
    base = old.tobytes()
    delta = _blob(codecs.encode_delta(new.tobytes(), base, hashlib.sha256(base).hexdigest(), 4))
    plain = _blob(codecs.encode(new.tobytes(), "zstd", 4, floating=True))
    assert len(delta) < 0.8 * len(plain)


def test_a_delta_without_its_base_cannot_decode_nor_serve_as_a_base():
    base = _weights()
    blob = _blob(codecs.encode_delta(_weights()[::-1], base, hashlib.sha256(base).hexdigest(), 4))
    with pytest.raises(CorruptChunkError, match="cannot be a base itself"):
        codecs.decode(blob, expected=len(base))
    with pytest.raises(CorruptChunkError, match="delta base is unusable.*cannot be a base itself"):
        codecs.decode(blob, lambda _d, _n: blob, expected=len(base))
    with pytest.raises(ValueError, match="same length"):
        codecs.encode_delta(b"abcd", b"abc", "00" * 32)


def test_broken_framing_is_refused():
    with pytest.raises(ValueError, match="unknown codec"):
        codecs.encode(b"x", "lz4")
    with pytest.raises(CorruptChunkError):
        codecs.decode(b"short", expected=5)
    raw_blob = _blob(codecs.encode(b"abcdef", "raw"))
    with pytest.raises(CorruptChunkError, match="header says"):
        codecs.decode(raw_blob[:-1], expected=6)
    with pytest.raises(CorruptChunkError, match="magic"):
        codecs.decode(b"XXXX" + raw_blob[4:], expected=6)
    blob = bytearray(_blob(codecs.encode(_weights(), "zstd", 4, floating=True)))
    head = codecs.HEADER.size
    for damage in (
        lambda b: b[: head + 10],  # cut inside the plane table
        lambda b: b[:-1],  # last plane cut short
        lambda b: b + b"\0",  # trailing garbage
        lambda b: b[:head] + bytes([b[head], 3]) + b[head + 2 :],  # wrong plane count
        lambda b: b[: head + 2] + bytes([9]) + b[head + 3 :],  # unknown plane mode
    ):
        with pytest.raises(CorruptChunkError):
            codecs.decode(bytes(damage(bytearray(blob))), expected=len(_weights()))


def test_legacy_byte_grouped_zstd_chunks_still_read():
    data = _weights(1000)
    grouped = np.ascontiguousarray(np.frombuffer(data, dtype=np.uint8).reshape(-1, 4).T).tobytes()
    import zstandard

    blob = codecs.HEADER.pack(codecs.MAGIC, codecs.ZSTD_V1, 4, len(data)) + zstandard.compress(grouped)
    assert codecs.header_codec(blob) == "zstd-v1"
    assert bytes(codecs.decode(blob, expected=len(data))) == data
    assert _decode_fed(blob, expected=len(data)) == data


def test_bf16_encoding_holds_exactly_bf16_values():
    exact = np.frombuffer(_weights(3000), dtype=np.float32)
    rounded = torch.from_numpy(exact.copy()).bfloat16().float().numpy()
    blob = _blob(codecs.encode_bf16(rounded.tobytes()))
    assert bytes(codecs.decode(blob, expected=rounded.nbytes)) == rounded.tobytes()
    assert _decode_fed(blob, expected=rounded.nbytes) == rounded.tobytes()
    assert len(blob) < 0.4 * rounded.nbytes
    with pytest.raises(ValueError, match="already rounded"):
        codecs.encode_bf16(exact.tobytes())


@pytest.mark.parametrize("n", [1, 255, 256, 1000])
def test_q8_encoding_holds_exactly_code_times_scale(n):
    values = np.frombuffer(_weights(n), dtype=np.float32) * np.float32(100)
    codes, scales = quantize_q8(values, 256)
    held, parts = codecs.encode_q8(codes, scales, 256)
    blob = _blob(parts)
    assert bytes(codecs.decode(blob, expected=held.nbytes)) == held.tobytes()
    assert np.max(np.abs(held - values)) <= np.max(scales) / 2 * 1.0001
    with pytest.raises(ValueError, match="need"):
        codecs.encode_q8(codes, scales[:0], 256)


def test_q8_chunk_of_subnormal_moments_decodes_alike_whatever_the_fp_mode_of_the_thread():
    """An optimizer moment that stopped receiving gradients (an unused embedding row) decays
    into fp32 subnormals, and so do its q8 scales and values. A thread that flushes
    subnormals (``torch.set_flush_denormal(True)``: FTZ/DAZ) must decode such a chunk to the
    bytes its address was hashed from where it was written, not zeros: else a sound lossy
    copy is refused, and recorded, as damaged."""
    tiny = np.float32(1e-39) * np.linspace(-1, 1, 700, dtype=np.float32)
    values = np.concatenate([tiny, np.float32(3e-36) * np.linspace(-1, 1, 300, dtype=np.float32)])
    codes, scales = quantize_q8(values, 256)
    held, parts = codecs.encode_q8(codes, scales, 256)
    assert np.count_nonzero(held) > 500  # written where subnormals are kept
    blob = _blob(parts)
    assert torch.set_flush_denormal(True)
    try:
        flushed = bytes(codecs.decode(blob, expected=held.nbytes))
        again, _ = codecs.encode_q8(codes, scales, 256)
    finally:
        torch.set_flush_denormal(False)
    assert flushed == held.tobytes()
    assert again.tobytes() == held.tobytes()
