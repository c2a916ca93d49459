"""Chunk encodings. A chunk's address is the hash of its RAW bytes (``checksum``), so re-encoding
(raw -> zstd) never changes what references it.

On-disk chunk = 14-byte header + payload. The header names the codec, the element
size and the raw length, so a reader needs nothing else, except for a delta chunk,
whose header is followed by the 32-byte address of its base chunk: the reader fetches
that chunk, verifies it, and XORs it back in.

Codecs (the id is header byte 4; every id a reader ever met stays readable):

* 0 ``raw``: the bytes as they are.
* 1 ``zstd-v1``: byte-grouped zstd as the first ckptflow wrote it (read only).
* 2 ``zstd``: byte planes, each stored, zstd or window nibbles (``planes``).
* 3 ``delta``: ``raw XOR base`` as byte planes; the base is the chunk of the same
  tensor slice in the run's newest full checkpoint, and is never itself a delta
  (chains stay one link long).
* 4 ``bf16`` and 5 ``q8``: exact encodings of values a lossy archive codec already
  rounded (fp32 values with zero low halves; 8-bit codes times a per-block scale). The
  loss happens before the address is computed (``ckptflow.chunks.lossy``), so these decode
  bit-exactly to the bytes their address names, like every other codec.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from ckptflow.chunks import planes
from ckptflow.errors import CorruptChunkError, decoding

MAGIC = b"CKC1"
HEADER = struct.Struct(">4sBBQ")
RAW, ZSTD_V1, ZSTD, DELTA, BF16, Q8 = 0, 1, 2, 3, 4, 5
CODEC_NAMES = {RAW: "raw", ZSTD_V1: "zstd-v1", ZSTD: "zstd", DELTA: "delta", BF16: "bf16", Q8: "q8"}
CODEC_IDS = {v: k for k, v in CODEC_NAMES.items()}
CODECS = ("raw", "zstd", "auto")  # what a Checkpointer writes new chunks with ("auto": chosen per chunk)
DIGEST_BYTES = 32
HEAD_BYTES = HEADER.size + DIGEST_BYTES  # enough of any chunk to know its codec and base
_Q8 = struct.Struct("<II")
_SECTION = struct.Struct("<I")

BaseReader = Callable[[str, int], bytes | memoryview]  # (base digest, raw length) -> the base chunk as stored


def _header(codec: int, itemsize: int, raw_len: int) -> bytes:
    return HEADER.pack(MAGIC, codec, itemsize, raw_len)


def encode(
    raw: bytes | memoryview, codec: str = "raw", itemsize: int = 1, *, level: int = 1, floating: bool = False
) -> list:
    """Header and payload buffers for ``raw`` (a list, so raw payloads are not copied).

    ``itemsize`` is the element size of the tensor the bytes belong to and ``floating``
    whether it is a floating-point dtype (both from the dtype, never assumed).
    """
    raw = memoryview(raw).cast("B")
    if codec == "raw":
        return [_header(RAW, 1, len(raw)), raw]
    if codec != "zstd":
        raise ValueError(f"unknown codec {codec!r}; choose one of raw, zstd")
    if itemsize < 1 or itemsize > 255 or len(raw) % itemsize:
        itemsize = 1
    return [_header(ZSTD, itemsize, len(raw)), *planes.encode(raw, itemsize, floating=floating, level=level)]


def encode_delta(
    raw: bytes | memoryview,
    base: bytes | memoryview,
    base_digest: str,
    itemsize: int = 1,
    *,
    level: int = 1,
    floating: bool = False,
) -> list:
    """``raw`` as the byte planes of ``raw XOR base``; the header names the base. Laid out
    like the base's own zstd planes (same element size and rotation), a reader XORs the
    two plane by plane and joins once."""
    new = np.frombuffer(raw, dtype=np.uint8)
    old = np.frombuffer(base, dtype=np.uint8)
    if len(new) != len(old):
        raise ValueError(f"a delta needs a base of the same length ({len(old)} != {len(new)} bytes)")
    if itemsize < 1 or itemsize > 255 or len(new) % itemsize:
        itemsize = 1
    head = _header(DELTA, itemsize, len(new)) + bytes.fromhex(base_digest)
    return [head, *planes.encode(np.bitwise_xor(new, old), itemsize, floating=floating, level=level)]


def encode_bf16(raw: bytes | memoryview, level: int = 1) -> list:
    """fp32 values that are exactly bf16 (low 16 bits zero) as their high halves."""
    words = np.frombuffer(raw, dtype="<u4")
    if np.any(words & np.uint32(0xFFFF)):
        raise ValueError("bf16 encoding holds only fp32 values already rounded to bf16")
    halves = (words >> np.uint32(16)).astype("<u2")
    return [_header(BF16, 4, len(words) * 4), *planes.encode(halves, 2, floating=True, level=level)]


def dequantize_q8(codes: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """``float32(code) * scale`` of each code's block: the values a q8 chunk holds.

    The one definition the lossy archive codec (which computes the address) and the
    decoder share, so the decoded bytes hash to the address bit for bit, whatever the
    thread's floating-point mode (``_subnormal_blocks``).
    """
    n = len(codes)
    out = np.empty(n, dtype="<f4")
    full = n // block * block
    if full:
        np.multiply(
            codes[:full].reshape(-1, block).astype(np.float32),
            scales[: full // block, None],
            out=out[:full].reshape(-1, block),
        )
    if full < n:
        np.multiply(codes[full:].astype(np.float32), scales[-1], out=out[full:])
    _subnormal_blocks(codes, scales, block, out)
    return out


def _subnormal_blocks(codes: np.ndarray, scales: np.ndarray, block: int, out: np.ndarray) -> None:
    """Redo in integers the blocks whose scale is zero or subnormal.

    A thread that flushes subnormals (``torch.set_flush_denormal(True)``: FTZ and DAZ)
    reads such a scale as zero and flushes a subnormal product, and the moments of a
    parameter that stopped receiving gradients decay into subnormals: that thread would
    decode other bytes than the address was hashed from, and a sound lossy copy would be
    refused (and recorded) as damaged. A product with a normal scale is normal (|code| >= 1)
    or zero, which no mode changes. With a subnormal scale ``m * 2**-149`` the product is
    ``k * 2**-149`` for the integer ``k = code * m``: an fp32 subnormal of mantissa ``k``
    below 2**23, else a normal float64 product rounded once to fp32, as the multiply does.
    """
    bits = np.ascontiguousarray(scales, dtype="<f4").view("<u4")
    small = (bits & np.uint32(0x7F800000)) == 0
    if not np.any(small):
        return
    for start in range(0, len(codes), planes.BLOCK):  # piece by piece: the temporaries stay small
        stop = min(start + planes.BLOCK, len(codes))
        if not np.any(small[start // block : (stop - 1) // block + 1]):
            continue
        scale = bits[np.arange(start, stop) // block]
        redo = (scale & np.uint32(0x7F800000)) == 0
        scale, code = scale[redo], codes[start:stop][redo]
        k = np.abs(code.astype(np.int64) * (scale & np.uint32(0x7FFFFF)))
        sign = ((scale >> np.uint32(31)) ^ (code < 0)).astype(np.uint32) << np.uint32(31)
        normal = (k * 2.0**-149).astype("<f4").view("<u4")  # k >= 2**23: a float64 normal, rounded once
        out.view("<u4")[start:stop][redo] = np.where(k < 1 << 23, k.astype(np.uint32), normal) | sign


def encode_q8(codes: np.ndarray, scales: np.ndarray, block: int, level: int = 1) -> tuple[np.ndarray, list]:
    """(the values it holds, header and payload) for int8 ``codes`` with one fp32
    ``scale`` per ``block`` codes."""
    codes = np.ascontiguousarray(codes, dtype=np.int8)
    scales = np.ascontiguousarray(scales, dtype="<f4")
    if len(scales) != -(-len(codes) // block):
        raise ValueError(f"{len(codes)} codes in blocks of {block} need {-(-len(codes) // block)} scales")
    values = dequantize_q8(codes, scales, block)
    scale_parts = planes.encode(scales, 4, floating=True, level=level)
    code_parts = planes.encode(codes, 1, floating=False, level=level)
    scale_len = sum(len(memoryview(p).cast("B")) for p in scale_parts)
    head = _header(Q8, 4, len(values) * 4) + _Q8.pack(block, len(scales)) + _SECTION.pack(scale_len)
    return values, [head, *scale_parts, *code_parts]


def header_codec(blob: bytes | memoryview) -> str:
    if len(blob) < HEADER.size or bytes(blob[:4]) != MAGIC:
        raise CorruptChunkError("chunk header is missing or has the wrong magic")
    return CODEC_NAMES.get(blob[4], f"unknown({blob[4]})")


def delta_base(head: bytes | memoryview) -> str | None:
    """The base digest a delta chunk's header names; None for any other chunk."""
    if len(head) < HEAD_BYTES or bytes(head[:4]) != MAGIC or head[4] != DELTA:
        return None
    return bytes(head[HEADER.size : HEAD_BYTES]).hex()


def raw_length(header: bytes | bytearray | memoryview) -> int | None:
    """The payload length a raw-codec header announces; None for any other header (a raw
    chunk is always written with element size 1, so another one there is damage)."""
    if len(header) < HEADER.size:
        return None
    magic, codec, itemsize, raw_len = HEADER.unpack_from(header)
    return raw_len if magic == MAGIC and codec == RAW and itemsize == 1 else None


def checkable_as_stored(header: bytes | bytearray | memoryview, raw_len: int) -> bool:
    """Whether a chunk with this header can be verified by the checksum of its stored
    bytes (``checksum.stored_checksum``): a well-formed header of an encoding that needs
    no base, announcing ``raw_len`` raw bytes. A delta also depends on its base's bytes,
    and a raw chunk is checked by the fast checksum of its payload instead."""
    if len(header) < HEADER.size:
        return False
    magic, codec, _itemsize, length = HEADER.unpack_from(header)
    return magic == MAGIC and codec in CODEC_NAMES and codec not in (RAW, DELTA) and length == raw_len


def max_encoded_size(raw_len: int) -> int:
    """The most bytes any codec stores for ``raw_len`` raw bytes (a plane is stored as it is
    when zstd would not shrink it; headers, plane table and zstd's worst case on top): a
    chunk object larger than this is refused before it is read."""
    return HEAD_BYTES + _Q8.size + _SECTION.size + 2 + 5 * 255 + raw_len + raw_len // 128 + 1024


# The most raw bytes one stored byte can decode to: a zstd RLE block holds up to 128 KiB in
# 4 bytes (2**15), a window-nibbles plane doubles that, and bf16 and q8 widen their planes
# to fp32 (2x and 4x).
MAX_EXPANSION = 1 << 17


def max_raw_size(stored: int) -> int:
    """The most raw bytes a chunk object of ``stored`` bytes can hold, whatever its codec:
    what bounds a size a manifest declares by the bytes on disk."""
    return max(0, stored - HEADER.size) * MAX_EXPANSION


def decode(
    blob: bytes | memoryview,
    base: BaseReader | None = None,
    *,
    expected: int,
    out: memoryview | None = None,
    consume: planes.Consumer | None = None,
) -> memoryview:
    """The raw bytes of an encoded chunk, the ``expected`` length its manifest records.

    ``CorruptChunkError`` if the header announces another length (checked before anything
    is decompressed, so a small chunk cannot claim gigabytes), if any zstd frame in it
    declares more than its part of that length (``planes.zstd_exact``), or if anything
    else goes wrong while decoding: every error but a store's, met while decoding bytes
    that were read, is damage (``errors.decoding``). No decoder allocates more than a
    small multiple of ``expected``.

    ``base`` supplies a delta chunk's base as stored; without it a delta cannot be
    decoded (which is how a base that is itself a delta is refused). The base is not
    verified here: a wrong base makes wrong bytes, which the delta's own address check
    catches (``ChunkStore`` then names the base).

    ``out`` (writable, ``expected`` bytes) receives the raw bytes, and is returned: zstd
    and delta chunks are joined straight into it, without a chunk-sized temporary. On
    an error it holds whatever was written before it.

    ``consume`` is handed the raw bytes in order, in pieces: a zstd chunk's (and most
    deltas') block by block as they are joined, while they are in the CPU cache, so a
    checksum of what was decoded costs no second trip to memory; any other's once decoded.
    """
    if len(blob) < HEADER.size:
        raise CorruptChunkError(f"chunk is {len(blob)} bytes, shorter than its header")
    magic, codec, itemsize, raw_len = HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptChunkError(f"chunk header magic is {magic!r}, expected {MAGIC!r}")
    if raw_len != expected:
        raise CorruptChunkError(f"chunk header announces {raw_len} raw bytes, the manifest expects {expected}")
    payload = memoryview(blob)[HEADER.size :]
    target = None
    if out is not None:
        target = np.frombuffer(memoryview(out).cast("B"), dtype=np.uint8)
        if len(target) != raw_len:
            raise ValueError(f"decode into {len(target)} bytes: the chunk holds {raw_len}")
    with decoding(f"{CODEC_NAMES.get(codec, codec)} chunk is malformed"):
        raw, fed = _decode(codec, itemsize, raw_len, payload, base, target, consume)
    if target is not None:
        if len(raw) != raw_len:
            raise CorruptChunkError(f"chunk decodes to {len(raw)} bytes, its header announces {raw_len}")
        view = planes.view(target)
        if raw.obj is not target:  # a codec that does not decode in place: copy once
            view[:] = raw
        raw = view
    if consume is not None and not fed:
        planes.feed(raw, consume)
    return raw


def _decode(
    codec: int,
    itemsize: int,
    raw_len: int,
    payload: memoryview,
    base: BaseReader | None,
    out: np.ndarray | None,
    consume: planes.Consumer | None,
) -> tuple[memoryview, bool]:
    """The raw bytes, and whether ``consume`` was handed them all while they were joined."""
    if codec == ZSTD:
        return planes.view(planes.decode(payload, raw_len, itemsize, out=out, consume=consume)), True
    if codec == DELTA:
        digest = bytes(payload[:DIGEST_BYTES]).hex()
        if base is None:
            raise CorruptChunkError(f"delta chunk on base {digest[:16]}… cannot be a base itself")
        base_blob = memoryview(base(digest, raw_len))
        joined, fed = _decode_delta(payload[DIGEST_BYTES:], raw_len, itemsize, base_blob, out, consume)
        return planes.view(joined), fed
    return _decode_whole(codec, itemsize, raw_len, payload), False


def _decode_whole(codec: int, itemsize: int, raw_len: int, payload: memoryview) -> memoryview:
    if codec == RAW:
        if itemsize != 1:
            raise CorruptChunkError(f"raw chunk header names element size {itemsize}; raw chunks are written with 1")
        if len(payload) != raw_len:
            raise CorruptChunkError(f"raw chunk holds {len(payload)} bytes, header says {raw_len}")
        return payload
    if codec == ZSTD_V1:
        return _decode_v1(payload, raw_len, itemsize)
    if codec in (BF16, Q8) and raw_len % 4:
        raise CorruptChunkError(f"{CODEC_NAMES[codec]} chunk announces {raw_len} raw bytes, not whole fp32 values")
    if codec == BF16:
        halves = planes.decode(payload, raw_len // 2, 2).view("<u2")
        words = np.empty(raw_len // 4, dtype="<u4")
        np.copyto(words, halves, casting="unsafe")
        words <<= np.uint32(16)
        return planes.view(words)
    if codec == Q8:
        block, count = _Q8.unpack_from(payload)
        (scale_len,) = _SECTION.unpack_from(payload, _Q8.size)
        start = _Q8.size + _SECTION.size
        n = raw_len // 4
        if block < 1 or count != -(-n // block):
            raise CorruptChunkError(f"q8 chunk names {count} scales for {n} values in blocks of {block}")
        scales = planes.decode(payload[start : start + scale_len], count * 4, 4).view("<f4")
        codes = planes.decode(payload[start + scale_len :], n, 1).view(np.int8)
        return planes.view(dequantize_q8(codes, scales, block))
    raise CorruptChunkError(f"chunk names unknown codec id {codec}")


def _decode_delta(
    payload: memoryview,
    raw_len: int,
    itemsize: int,
    base: memoryview,
    out: np.ndarray | None,
    consume: planes.Consumer | None,
) -> tuple[np.ndarray, bool]:
    """XOR the base back in: plane by plane when the base's zstd planes are laid out like
    the delta's (one join for both, ``consume`` fed as it joins: True), else on the
    joined bytes (``consume`` not fed: False)."""
    mine, rotated = planes.decode_planes(payload, raw_len, itemsize)
    with decoding("its delta base is unusable"):
        try:
            theirs = _base_planes(base, raw_len, itemsize, len(mine), rotated=rotated)
            # decoded without a base reader: a base that is itself a delta is refused
            old = None if theirs is not None else np.frombuffer(decode(base, expected=raw_len), dtype=np.uint8)
        except CorruptChunkError as e:
            raise CorruptChunkError(f"its delta base is unusable: {e}") from None
    if out is None:
        out = np.empty(raw_len, dtype=np.uint8)
    if theirs is not None:
        planes.join(planes.xor_planes(mine, theirs), out, rotated=rotated, consume=consume)
        return out, True
    if old is None or len(old) != raw_len:
        raise CorruptChunkError(f"its delta base holds {0 if old is None else len(old)} bytes, not {raw_len}")
    planes.join(mine, out, rotated=rotated)
    np.bitwise_xor(out, old, out=out)
    return out, False


def _base_planes(base: memoryview, raw_len: int, itemsize: int, count: int, *, rotated: bool) -> list | None:
    if len(base) < HEADER.size:
        return None
    magic, codec, base_itemsize, base_len = HEADER.unpack_from(base)
    if magic != MAGIC or codec != ZSTD or base_itemsize != itemsize or base_len != raw_len:
        return None
    theirs, base_rotated = planes.decode_planes(base[HEADER.size :], raw_len, itemsize)
    return theirs if len(theirs) == count and base_rotated == rotated else None


def _decode_v1(payload: memoryview, raw_len: int, itemsize: int) -> memoryview:
    grouped = planes.zstd_exact(payload, raw_len, "zstd-v1 payload")
    if itemsize <= 1:
        return memoryview(grouped)
    arr = np.frombuffer(grouped, dtype=np.uint8)
    return planes.view(np.ascontiguousarray(arr.reshape(itemsize, -1).T).reshape(-1))
