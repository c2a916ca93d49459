"""Chunk encodings. A chunk's address is the sha256 of its RAW bytes, so re-encoding
(raw -> zstd) never changes what references it.

On-disk chunk = 14-byte header + payload. The header names the codec, the element
size used for byte grouping and the raw length, so a reader needs nothing else.

Byte grouping: float weights compress poorly with plain zstd because sign/exponent
bytes and noisy mantissa bytes interleave. Transposing an ``n x itemsize`` byte matrix
puts all exponent bytes together, which zstd then shrinks well.
"""

from __future__ import annotations

import struct

import zstandard

from ckptflow.errors import CorruptChunkError

MAGIC = b"CKC1"
HEADER = struct.Struct(">4sBBQ")
RAW, ZSTD_BYTEGROUP = 0, 1
CODEC_NAMES = {RAW: "raw", ZSTD_BYTEGROUP: "zstd"}
CODEC_IDS = {v: k for k, v in CODEC_NAMES.items()}
CODECS = tuple(CODEC_IDS)  # what a Checkpointer may write new chunks with


def _group(raw: memoryview, itemsize: int) -> bytes:
    import numpy as np  # only where floats are grouped: the CLI's listing commands never need it

    arr = np.frombuffer(raw, dtype=np.uint8)
    return np.ascontiguousarray(arr.reshape(-1, itemsize).T).tobytes()


def _ungroup(grouped: bytes, itemsize: int) -> bytes:
    import numpy as np

    arr = np.frombuffer(grouped, dtype=np.uint8)
    return np.ascontiguousarray(arr.reshape(itemsize, -1).T).tobytes()


def encode(raw: bytes | memoryview, codec: str = "raw", itemsize: int = 1, level: int = 3) -> list:
    """Header and payload buffers for ``raw`` (a list, so raw payloads are not copied)."""
    raw = memoryview(raw).cast("B")
    if codec == "raw":
        return [HEADER.pack(MAGIC, RAW, 1, len(raw)), raw]
    if codec != "zstd":
        raise ValueError(f"unknown codec {codec!r}; choose one of {sorted(CODEC_IDS)}")
    if itemsize <= 1 or len(raw) % itemsize:
        itemsize = 1
    grouped = _group(raw, itemsize) if itemsize > 1 else raw
    payload = zstandard.ZstdCompressor(level=level).compress(grouped)
    return [HEADER.pack(MAGIC, ZSTD_BYTEGROUP, itemsize, len(raw)), payload]


def header_codec(blob: bytes) -> str:
    if len(blob) < HEADER.size or blob[:4] != MAGIC:
        raise CorruptChunkError("chunk header is missing or has the wrong magic")
    return CODEC_NAMES.get(blob[4], f"unknown({blob[4]})")


def raw_length(header: bytes | bytearray | memoryview) -> int | None:
    """The payload length a raw-codec header announces; None for any other header."""
    if len(header) < HEADER.size:
        return None
    magic, codec, _itemsize, raw_len = HEADER.unpack_from(header)
    return raw_len if magic == MAGIC and codec == RAW else None


def max_encoded_size(raw_len: int) -> int:
    """The most bytes any codec stores for ``raw_len`` raw bytes (zstd's worst-case bound
    plus the header): a chunk object larger than this is refused before it is read."""
    return HEADER.size + raw_len + raw_len // 128 + 1024


def decode(blob: bytes, expected: int | None = None) -> memoryview:
    """The raw bytes of an encoded chunk; ``CorruptChunkError`` if the framing is broken
    or the header announces another length than the ``expected`` one (checked before
    anything is decompressed, so a small chunk cannot claim gigabytes)."""
    if len(blob) < HEADER.size:
        raise CorruptChunkError(f"chunk is {len(blob)} bytes, shorter than its header")
    magic, codec, itemsize, raw_len = HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptChunkError(f"chunk header magic is {magic!r}, expected {MAGIC!r}")
    if expected is not None and raw_len != expected:
        raise CorruptChunkError(f"chunk header announces {raw_len} raw bytes, the manifest expects {expected}")
    payload = memoryview(blob)[HEADER.size :]
    if codec == RAW:
        if len(payload) != raw_len:
            raise CorruptChunkError(f"raw chunk holds {len(payload)} bytes, header says {raw_len}")
        return payload
    if codec == ZSTD_BYTEGROUP:
        try:
            grouped = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_len)
        except zstandard.ZstdError as e:
            raise CorruptChunkError(f"zstd payload does not decompress: {e}") from None
        if len(grouped) != raw_len:
            raise CorruptChunkError(f"zstd chunk decodes to {len(grouped)} bytes, header says {raw_len}")
        return memoryview(_ungroup(grouped, itemsize) if itemsize > 1 else grouped)
    raise CorruptChunkError(f"chunk names unknown codec id {codec}")
