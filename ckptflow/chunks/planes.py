"""Byte planes: the lossless transform behind the "zstd" and "delta" chunk codecs.

Float weights barely shrink under plain zstd because each element interleaves an
exponent (a few distinct values) with mantissa bits (noise). Splitting a chunk of
``itemsize``-byte elements into ``itemsize`` planes (plane j = byte j of every
element, most significant first) puts the exponents together. For floating-point
data each element is first rotated left by one bit, so the sign moves to the least
significant plane and the most significant plane holds exactly the exponent (all 8
bits of a bf16 or fp32 exponent; fp16's 5 exponent bits plus 3 mantissa bits).

Each plane is then stored the cheapest of three ways: as it is (mantissa noise: zstd
would only add a frame), zstd, or *window nibbles*: an exponent plane whose values
nearly all fall in 15 consecutive values is stored as 4-bit offsets packed two per
byte (the rest escaped), then zstd. zstd's fast match finder spends bits on spurious
matches in such noisy low-entropy data; the packed form gets within 1 % of the plane's
order-0 entropy, which is what brings bf16 weights to about 0.66x. It decodes at half
zstd's speed, so it is used for 2-byte elements only, where the exponent plane is half
the data (for fp32 it would save under 1 % of the chunk).

Payload layout (all integers little-endian)::

    u8 flags (bit 0: rotated)   u8 planes
    per plane: u8 mode, u32 body length
    the bodies, in plane order
    mode 0 raw: the plane's bytes
    mode 1 zstd: one zstd frame
    mode 2 nibbles: u8 lo, u32 packed frame length, zstd frame of the packed offsets,
                    then the escaped bytes (the plane values outside lo..lo+14), in order
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable

import numpy as np
import zstandard

from ckptflow.errors import CorruptChunkError

STORED, ZSTD, NIBBLES = 0, 1, 2
_HEAD = struct.Struct("<BB")
_PLANE = struct.Struct("<BI")
_NIBBLE_HEAD = struct.Struct("<BI")
_UINTS: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
ROTATED = 1
WINDOW = 15  # offsets 0..14 are values; 15 marks an escape
SAMPLE_RUN = 16 << 10
STORE_ABOVE = 0.93  # a plane zstd shrinks less than this is stored: decoding it would cost more than it saves
_local = threading.local()


def view(array: np.ndarray) -> memoryview:
    """A contiguous array's bytes, without a copy."""
    return memoryview(array).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


BLOCK = 1 << 16  # elements per pass: the temporaries stay in the CPU cache
PIECE = 256 << 10  # bytes per piece handed to a consumer of bytes that were not joined (``feed``)
Consumer = Callable[[memoryview], None]  # what is handed decoded bytes as they are produced


def _scratch(n: int, dtype: np.dtype) -> np.ndarray:
    buf = getattr(_local, "scratch", None)
    if buf is None or len(buf) < n * dtype.itemsize:
        buf = _local.scratch = np.empty(n * dtype.itemsize, dtype=np.uint8)
    return buf[: n * dtype.itemsize].view(dtype)


def xor_planes(mine: list[np.ndarray], theirs: list[np.ndarray]) -> list[np.ndarray]:
    """``mine XOR theirs`` plane by plane, into a per-thread buffer (valid until this
    thread's next call): XOR commutes with the split, so a delta and its base join once."""
    total = sum(len(p) for p in mine)
    buf = getattr(_local, "xor", None)
    if buf is None or len(buf) < total:
        buf = _local.xor = np.empty(total, dtype=np.uint8)
    out, start = [], 0
    for a, b in zip(mine, theirs):
        out.append(np.bitwise_xor(a, b, out=buf[start : start + len(a)]))
        start += len(a)
    return out


def split(raw: memoryview | bytes | np.ndarray, itemsize: int, *, floating: bool) -> tuple[list[np.ndarray], bool]:
    """Planes of ``raw`` (most significant byte first) and whether elements were rotated.

    Byte j of an element rotated left by one bit is its bits ``8(k-1-j)-1 ..``, so the
    rotation costs no pass of its own; the work goes block by block so that the
    temporaries stay in cache.
    """
    data = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.view(np.uint8)
    if itemsize not in _UINTS or len(data) % itemsize:
        return [data], False
    dtype = _UINTS[itemsize]
    x = data.view(dtype)
    n = len(x)
    planes = [np.empty(n, dtype=np.uint8) for _ in range(itemsize)]
    tmp = _scratch(min(n, BLOCK), dtype)
    top = 8 * itemsize - 1
    for start in range(0, n, BLOCK):
        xb = x[start : start + BLOCK]
        tb = tmp[: len(xb)]
        for j, plane in enumerate(planes):
            shift = 8 * (itemsize - 1 - j)
            out = plane[start : start + len(xb)]
            if floating and not shift:  # the low plane: 7 low bits, then the sign
                np.left_shift(xb, 1, out=tb)
                np.copyto(out, tb, casting="unsafe")
                np.right_shift(xb, top, out=tb)
                np.bitwise_or(out, tb, out=out, casting="unsafe")
            else:
                np.right_shift(xb, shift - 1 if floating else shift, out=tb)
                np.copyto(out, tb, casting="unsafe")
    return planes, floating


def join(planes: list[np.ndarray], out: np.ndarray, *, rotated: bool, consume: Consumer | None = None) -> None:
    """Inverse of ``split``: write the element bytes into ``out`` (uint8, the raw length),
    handing each block to ``consume`` as soon as it is joined, while it is in the CPU cache."""
    k = len(planes)
    if k == 1:
        out[:] = planes[0]
        if consume is not None:
            feed(out, consume)
        return
    dtype = _UINTS[k]
    x = out.view(dtype)
    tmp = _scratch(min(len(x), BLOCK), dtype)
    top = 8 * k - 1
    for start in range(0, len(x), BLOCK):
        xb = x[start : start + BLOCK]
        tb = tmp[: len(xb)]
        for j, plane in enumerate(planes):
            shift = 8 * (k - 1 - j)
            pb = plane[start : start + len(xb)]
            if rotated and not shift:  # 7 low bits, then the sign
                np.copyto(tb, pb, casting="unsafe")
                np.right_shift(tb, 1, out=tb)
                xb |= tb
                np.copyto(tb, pb, casting="unsafe")
                np.left_shift(tb, top, out=tb)
            else:
                np.copyto(tb, pb, casting="unsafe")
                np.left_shift(tb, shift - 1 if rotated else shift, out=tb)
            if j:
                xb |= tb
            else:
                xb[:] = tb
        if consume is not None:
            consume(view(xb))


def feed(raw: np.ndarray | memoryview, consume: Consumer) -> None:
    """Hand ``raw`` to ``consume`` in cache-sized pieces."""
    data = memoryview(raw).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
    for start in range(0, len(data), PIECE):
        consume(data[start : start + PIECE])


def _window(plane: np.ndarray) -> tuple[int, float]:
    """The start of the 15-value window holding most of ``plane`` (from a sample), and its share."""
    sample = plane[:: max(1, len(plane) // 65536)]
    counts = np.bincount(sample, minlength=256)
    cum = np.concatenate(([0], np.cumsum(counts)))
    mass = cum[WINDOW:] - cum[:-WINDOW]
    lo = int(np.argmax(mass))
    return lo, float(mass[lo]) / max(1, len(sample))


def _nibbles(plane: np.ndarray, lo: int, level: int) -> bytes:
    offsets = plane - np.uint8(lo)  # values below lo wrap around to >= 15: escapes
    escapes = plane[offsets >= WINDOW]
    np.minimum(offsets, WINDOW, out=offsets)
    if len(offsets) % 2:
        offsets = np.append(offsets, np.uint8(0))
    pairs = offsets.reshape(-1, 2)
    packed = np.left_shift(pairs[:, 0], 4)
    packed |= pairs[:, 1]
    frame = _compressor(level).compress(view(packed))
    return _NIBBLE_HEAD.pack(lo, len(frame)) + frame + escapes.tobytes()


def _unnibble(body: memoryview, n: int) -> np.ndarray:
    lo, size = _NIBBLE_HEAD.unpack_from(body)
    start = _NIBBLE_HEAD.size
    packed = np.frombuffer(zstd_exact(body[start : start + size], (n + 1) // 2, "nibble plane"), dtype=np.uint8)
    offsets = np.empty((len(packed), 2), dtype=np.uint8)
    np.right_shift(packed, 4, out=offsets[:, 0])
    np.bitwise_and(packed, 15, out=offsets[:, 1])
    offsets = offsets.reshape(-1)[:n]
    escaped = offsets == WINDOW
    plane = offsets + np.uint8(lo)
    escapes = np.frombuffer(body[start + size :], dtype=np.uint8)
    if int(np.count_nonzero(escaped)) != len(escapes):
        raise CorruptChunkError(f"nibble plane names {int(np.count_nonzero(escaped))} escapes but holds {len(escapes)}")
    plane[escaped] = escapes
    return plane


MIN_WINDOW = 1 << 10  # zstd's smallest window: what a frame of up to 1 KiB may name


def zstd_exact(frame: memoryview | bytes, size: int, what: str = "zstd plane") -> bytes:
    """Exactly ``size`` bytes from one zstd frame, never more memory than that.

    The frame's header is read first: a declared content size other than ``size``, a
    window larger than ``size`` needs (a compressor never names one larger than its
    input) or a dictionary is refused before anything is decompressed, since
    python-zstandard allocates whatever a frame declares (``max_output_size`` only
    bounds frames that declare nothing). A frame without a declared size (ckptflow
    never writes one) is streamed and stopped one byte past ``size``.
    """
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as e:
        raise CorruptChunkError(f"{what} has no readable zstd frame header: {e}") from None
    if params.dict_id:
        raise CorruptChunkError(f"{what} names zstd dictionary {params.dict_id}; ckptflow never uses one")
    if params.window_size > max(size, MIN_WINDOW):
        raise CorruptChunkError(f"{what} asks for a {params.window_size}-byte zstd window to decode {size} bytes")
    try:
        if params.content_size != zstandard.CONTENTSIZE_UNKNOWN:
            if params.content_size != size:
                raise CorruptChunkError(f"{what} declares {params.content_size} bytes, expected {size}")
            out = _decompressor().decompress(frame)
        else:
            out = _streamed(frame, size)
    except zstandard.ZstdError as e:
        raise CorruptChunkError(f"{what} does not decompress: {e}") from None
    if len(out) != size:
        more = "more than" if len(out) > size else f"{len(out)} bytes, not"
        raise CorruptChunkError(f"{what} decodes to {more} {size} bytes")
    return out


def _streamed(frame: memoryview | bytes, size: int) -> bytes:
    """At most ``size + 1`` bytes of a frame that does not declare its size."""
    pieces, got = [], 0
    with _decompressor().stream_reader(frame, read_across_frames=False) as reader:
        while got <= size:
            piece = reader.read(size + 1 - got)
            if not piece:
                break
            pieces.append(piece)
            got += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _sample(plane: np.ndarray) -> np.ndarray:
    """Four evenly spaced runs of 16 KiB: enough for zstd to show what it would do."""
    if len(plane) <= 4 * SAMPLE_RUN:
        return plane
    step = (len(plane) - SAMPLE_RUN) // 3
    return np.concatenate([plane[i * step : i * step + SAMPLE_RUN] for i in range(4)])


def encode_plane(plane: np.ndarray, level: int, *, nibbles: bool = True) -> tuple[int, bytes | np.ndarray]:
    """The smallest of stored, zstd and (for exponent-like planes, if ``nibbles``) window
    nibbles, chosen on a sample so that only the winner is computed in full."""
    sample = _sample(plane)
    frame = _compressor(level).compress(view(sample))
    zstd_ratio = len(frame) / max(1, len(sample))
    if zstd_ratio > STORE_ABOVE:
        return STORED, plane
    if nibbles and 0.15 < zstd_ratio < 0.8:  # neither noise nor nearly constant: an exponent plane?
        lo, share = _window(sample)
        if share > 0.9 and len(_nibbles(sample, lo, level)) < len(frame):
            packed = _nibbles(plane, lo, level)
            return (NIBBLES, packed) if len(packed) < len(plane) else (STORED, plane)
    if sample is not plane:  # the sample was part of the plane: now the whole of it
        frame = _compressor(level).compress(view(plane))
    return (ZSTD, frame) if len(frame) < len(plane) else (STORED, plane)


def encode(raw: memoryview | bytes | np.ndarray, itemsize: int, *, floating: bool, level: int = 1) -> list[memoryview]:
    """The planes payload of ``raw`` as buffers (stored planes are not copied again)."""
    planes, rotated = split(raw, itemsize, floating=floating)
    nibbles = len(planes) <= 2  # where the exponent plane is half the data; wider, zstd decodes faster
    bodies = [(mode, _as_view(body)) for mode, body in (encode_plane(p, level, nibbles=nibbles) for p in planes)]
    head = _HEAD.pack(ROTATED if rotated else 0, len(planes))
    table = b"".join(_PLANE.pack(mode, len(body)) for mode, body in bodies)
    return [memoryview(head + table), *(body for _, body in bodies)]


def _as_view(body: bytes | np.ndarray) -> memoryview:
    return view(body) if isinstance(body, np.ndarray) else memoryview(body)


def size(parts: list) -> int:
    """Bytes in a list of buffers."""
    return sum(memoryview(p).nbytes for p in parts)


def decode_planes(payload: memoryview, raw_len: int, itemsize: int) -> tuple[list[np.ndarray], bool]:
    """The planes of a planes payload, not yet joined, and whether its elements were rotated."""
    if len(payload) < _HEAD.size:
        raise CorruptChunkError("planes payload is shorter than its header")
    flags, count = _HEAD.unpack_from(payload)
    if count not in (1, itemsize) or raw_len % count or ((flags & ROTATED or count > 1) and count not in _UINTS):
        raise CorruptChunkError(f"planes payload names {count} planes for {itemsize}-byte elements of {raw_len} bytes")
    n = raw_len // count
    offset = _HEAD.size + count * _PLANE.size
    if len(payload) < offset:
        raise CorruptChunkError("planes payload is shorter than its plane table")
    planes = []
    for j in range(count):
        mode, size = _PLANE.unpack_from(payload, _HEAD.size + j * _PLANE.size)
        body = payload[offset : offset + size]
        if len(body) != size:
            raise CorruptChunkError(f"plane {j} is cut short ({len(body)} of {size} bytes)")
        offset += size
        if mode == STORED:
            if size != n:
                raise CorruptChunkError(f"stored plane {j} holds {size} bytes, expected {n}")
            planes.append(np.frombuffer(body, dtype=np.uint8))
        elif mode == ZSTD:
            planes.append(np.frombuffer(zstd_exact(body, n), dtype=np.uint8))
        elif mode == NIBBLES:
            planes.append(_unnibble(body, n))
        else:
            raise CorruptChunkError(f"plane {j} has unknown mode {mode}")
    if offset != len(payload):
        raise CorruptChunkError(f"planes payload has {len(payload) - offset} trailing bytes")
    return planes, bool(flags & ROTATED)


def decode(
    payload: memoryview, raw_len: int, itemsize: int, *, out: np.ndarray | None = None, consume: Consumer | None = None
) -> np.ndarray:
    """The raw bytes of a planes payload, as a uint8 array: ``out`` (``raw_len`` bytes) if
    given, so a restore decodes straight into its destination; ``consume`` (``join``)."""
    planes, rotated = decode_planes(payload, raw_len, itemsize)
    if out is None:
        out = np.empty(raw_len, dtype=np.uint8)
    join(planes, out, rotated=rotated, consume=consume)
    return out
