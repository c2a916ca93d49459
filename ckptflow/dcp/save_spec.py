"""What one rank's writer is asked to save, beyond the tensors DCP hands it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ckptflow.chunks.codecs import CODECS
from ckptflow.dcp.auto_codec import SaveEncoder
from ckptflow.dcp.packs import PACK_BYTES
from ckptflow.dcp.save_clock import SaveClock
from ckptflow.format import layout as fmt


def check_layout(*, chunk_bytes: int, pack_bytes: int, codec: str) -> None:
    """Refuse a chunk size, pack size or codec no save can use, where it is given (a
    ``Checkpointer``'s arguments), not at the first save hours into a run."""
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive number of bytes (default 8 MiB), got {chunk_bytes!r}")
    if isinstance(pack_bytes, bool) or not isinstance(pack_bytes, int) or not 0 <= pack_bytes <= fmt.MAX_PACK_BYTES:
        raise ValueError(
            f"pack_bytes must be a number of bytes up to {fmt.MAX_PACK_BYTES} (64 MiB), 0 for no packs"
            f" (default 1 MiB), got {pack_bytes!r}"
        )
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")


@dataclass
class SaveSpec:
    """Everything one rank's writer needs beyond the tensors DCP hands it."""

    run: str
    step: int
    kind: str  # "full" rewrites every chunk; "incremental" trusts chunks already stored
    base_step: int | None
    skeleton: Any
    rng: dict | None
    metadata: dict
    world_size: int
    save_id: str  # one id per save attempt, shared by all ranks; ties rank records to their manifest
    chunk_bytes: int = 8 << 20
    pack_bytes: int = PACK_BYTES  # small tensors share chunks of up to this (and chunk_bytes); 0: none (``packs``)
    codec: str = "raw"
    created_at: float = field(default_factory=time.time)
    encoder: SaveEncoder | None = None  # codec "auto": chooses raw, zstd or a delta per chunk
    tied: list[list[str]] = field(default_factory=list)  # tensor names sharing one storage (manifest "tied")
    lossy: dict | None = None  # the state is a lossy copy's (an import of its export): its ``lossy`` record
    replaces: str | None = None  # sha256 of a manifest at the step proved damaged when the save began
    clock: SaveClock | None = None  # times the save for the manifest's ``save_cost`` record
    decision: dict | None = None  # why an adaptive policy saved this step (manifest ``save_decision``)
