"""The one way tests damage a store: flip a byte of a file, found by checkpoint and tensor."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import listing as catalog_listing
from ckptflow.format import layout as fmt
from ckptflow.store import open_store


def flip_byte(path: str | os.PathLike, offset: int = -1) -> None:
    """XOR one byte of ``path`` with 0xFF (``offset`` from the start, or from the end if negative)."""
    blob = bytearray(Path(path).read_bytes())
    blob[offset] ^= 0xFF
    Path(path).write_bytes(bytes(blob))


def chunk_path(root: str | os.PathLike, digest: str) -> Path:
    return Path(root) / fmt.chunk_key(digest)


def chunks_of(root: str | os.PathLike, run: str, step: int) -> dict[str, int]:
    """digest -> raw length of every chunk ``(run, step)`` needs."""
    return dict(catalog.read_manifest(open_store(os.fspath(root)), run, step).chunks)


def only_in(root: str | os.PathLike, run: str, step: int, *others: int) -> list[str]:
    """Chunks of ``step`` that none of the ``others`` steps use, sorted."""
    used = set().union(*(chunks_of(root, run, s) for s in others)) if others else set()
    return sorted(set(chunks_of(root, run, step)) - used)


def tensor_chunk(root: str | os.PathLike, run: str, step: int, fqn: str) -> str:
    """The first chunk of tensor ``fqn`` in ``(run, step)``."""
    manifest = catalog.read_manifest(open_store(os.fspath(root)), run, step)
    (item,) = [i for i in manifest.items() if i.fqn == fqn]
    return item.chunks[0][0]


def corrupt_chunk(root: str | os.PathLike, run: str, step: int, digest: str | None = None) -> str:
    """Flip the last byte of a chunk of ``(run, step)``: ``digest``, or by default the first
    (by digest) that no other checkpoint of the run uses, so only this one is damaged."""
    if digest is None:
        others = [s for s in catalog_listing.committed_steps(open_store(os.fspath(root)), run) if s != step]
        digest = only_in(root, run, step, *others)[0]
    flip_byte(chunk_path(root, digest))
    return digest


def tree_bytes(root: str | os.PathLike) -> dict[str, bytes]:
    """Every file below ``root`` by its relative path: what a refused operation must leave as it was."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def manifest_path(root: str | os.PathLike, run: str, step: int) -> Path:
    return Path(root) / fmt.manifest_key(run, step)


def reseal_manifest(root: str | os.PathLike, run: str, step: int, mutate) -> None:
    """Apply ``mutate`` to the manifest's JSON and seal it again: a record whose checksum
    is valid but whose content a buggy or hostile writer got wrong."""
    import json

    from ckptflow.format.sealed import seal

    path = manifest_path(root, run, step)
    record = json.loads(path.read_bytes())
    record.pop("checksum")
    mutate(record)
    path.write_bytes(seal(record))


def grow_first_tensor(record: dict) -> None:
    """Make the first tensor one row larger than its shards cover."""
    tensor = next(iter(record["dcp"]["tensors"].values()))
    tensor["size"][0] += 1


def rank_files(store, run: str, step: int) -> set[str]:
    """Keys of every rank record under a step (whichever save attempt wrote them)."""
    from ckptflow.store import open_store as _open

    store = _open(os.fspath(store)) if isinstance(store, (str, os.PathLike)) else store
    return {info.key for info in store.list(fmt.step_prefix(run, step) + "ranks/")}


# ---- inside an encoded chunk: its zstd frames ---------------------------------------------
# The chunk layout (``ckptflow.chunks.codecs``, ``ckptflow.chunks.planes``), parsed here independently so
# that a bug in the decoder cannot hide the frames a test must damage.
CHUNK_HEADER = 14  # magic (4), codec id (1), element size (1), raw length (8)
DIGEST = 32  # a delta's base address, after its header
PLANE_CODECS = {2: "zstd", 3: "delta", 4: "bf16"}  # codec ids whose payload is one planes payload


def codec_of(blob: bytes) -> str:
    return PLANE_CODECS.get(blob[4], "raw" if blob[4] == 0 else f"id {blob[4]}")


def zstd_frames(blob: bytes) -> list[tuple[int, int, str]]:
    """``(offset, length, plane mode)`` of every zstd frame in a zstd, delta or bf16 chunk:
    a zstd plane's body, and the packed offsets of a window-nibbles plane."""
    start = CHUNK_HEADER + (DIGEST if codec_of(blob) == "delta" else 0)
    count = blob[start + 1]
    body = start + 2 + 5 * count
    frames = []
    for j in range(count):
        mode, size = struct.unpack_from("<BI", blob, start + 2 + 5 * j)
        if mode == 1:
            frames.append((body, size, "zstd"))
        elif mode == 2:
            (packed,) = struct.unpack_from("<I", blob, body + 1)
            frames.append((body + 5, packed, "nibbles"))
        body += size
    return frames


def flip_bit(path: str | os.PathLike, offset: int, bit: int) -> None:
    """XOR one bit of ``path`` (flipping it again restores the file)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def one_plane_zstd_chunk(raw_len: int, frame: bytes) -> bytes:
    """A zstd chunk (element size 1) announcing ``raw_len`` raw bytes, its one plane ``frame``:
    what a forger writes to make a small chunk of a manifest decode to whatever it likes."""
    header = b"CKC1" + struct.pack(">BBQ", 2, 1, raw_len)
    return header + struct.pack("<BB", 0, 1) + struct.pack("<BI", 1, len(frame)) + frame
