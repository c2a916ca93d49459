"""Rank bodies for interop/test_import_dcp_pieces.py: a plain ``dcp.save`` (no ckptflow) of
DTensors sharded along different dimensions by two gloo ranks, the kind of directory an
import must assemble from several pieces per tensor (run by ``dist_workers.launch``)."""

from __future__ import annotations

from pathlib import Path

import torch


def full_state() -> dict[str, torch.Tensor]:
    """The unsharded tensors, the same on every rank: arbitrary bit patterns (NaNs with
    payloads, -0.0, denormals), so only a bit-exact assembly compares equal."""
    g = torch.Generator().manual_seed(20)
    bits = torch.randint(-(2**31), 2**31 - 1, (9 * 5 + 2 * 3 * 7,), generator=g, dtype=torch.int32)
    return {
        "rows": bits[:45].view(torch.float32).reshape(9, 5).clone(),  # 9 rows over 2 ranks: 5 + 4
        "cols": bits[:45].view(torch.bfloat16)[:45].reshape(9, 5).clone(),  # 5 columns: 3 + 2
        "cube": bits[45:].view(torch.float32).reshape(2, 3, 7).clone(),  # last dimension: 4 + 3
        "tiny": torch.tensor([[1.5, -2.0, 3.25]]),  # 1 row over 2 ranks: rank 1's piece is empty
        "rep": torch.arange(6, dtype=torch.int64),
    }


def save_plain(rank: int, world: int, workdir: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = full_state()
    state = {
        "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
        "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
        "cube": distribute_tensor(full["cube"], mesh, [Shard(2)]),
        "tiny": distribute_tensor(full["tiny"], mesh, [Shard(0)]),
        "rep": full["rep"],
        "epoch": 7,
    }
    dcp.save(state, storage_writer=FileSystemWriter(str(workdir / "dcp")))
    return {"rank": rank}


SCENARIOS = {"save_plain": save_plain}
