"""Counting decodes: which chunks a restore decoded, once per decode (``ChunkStore._decoded``
is the one place every chunk is decoded and verified)."""

from __future__ import annotations

from ckptflow.chunks.io import ChunkStore


def count_decodes(monkeypatch) -> list[str]:
    """The digests decoded from now on, in order, one entry per decode."""
    calls: list[str] = []
    decode = ChunkStore._decoded

    def counting(self, digest, blob, size, **kwargs):
        calls.append(digest)
        return decode(self, digest, blob, size, **kwargs)

    monkeypatch.setattr(ChunkStore, "_decoded", counting)
    return calls
