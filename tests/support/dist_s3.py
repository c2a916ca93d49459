"""Rank bodies for dcp/test_distributed_s3.py: many ranks saving to and restoring from S3.

Each rank holds a DTensor-sharded model (rows split over the ranks, unevenly) and its
AdamW state, trains it with gradients that are a function of the step, and saves it to a
bucket on the moto S3 server (``config.json`` in the scenario's directory names the hot
and the archive store). A fingerprint (sha256 of every full tensor, the optimizer's
hyperparameters) taken at each save is what a restore on any world size must reproduce.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

RUN = "ranks"
ROWS, COLS = 10, 6  # 10 rows: 3+3+3+1 on 4 ranks, 5+5 on 2
CHUNK = 64  # bytes: every shard of every tensor spans one or more chunks
# (step, kind, blocking): sync and async, full and incremental
SAVES = [(1, "full", True), (2, "incremental", True), (3, "full", False), (4, "incremental", False)]
ARCHIVED = 4  # the step archived to the second bucket, then expired from the hot one


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) / 7)
        self.b = nn.Parameter(torch.linspace(-1, 1, ROWS))
        # never trained: an incremental save finds its chunks already stored
        self.register_buffer("table", torch.arange(ROWS * COLS, dtype=torch.float64).reshape(ROWS, COLS))


def sharded(world: int, blank: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model with every tensor Shard(0) over all ranks, and AdamW over it; ``blank``:
    all zeros, what a restore must fill."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def shard(_name, module, mesh):
        for name, p in list(module.named_parameters(recurse=False)):
            value = torch.zeros_like(p) if blank else p.detach()
            module.register_parameter(name, nn.Parameter(distribute_tensor(value, mesh, [Shard(0)])))
        for name, b in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, distribute_tensor(torch.zeros_like(b) if blank else b, mesh, [Shard(0)]))

    model = distribute_module(Net(), mesh, shard)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    """One AdamW step on gradients that depend only on ``step`` (the same on any world size)."""
    from torch.distributed.tensor import distribute_tensor

    for i, p in enumerate(model.parameters()):
        g = torch.sin(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * (step + i) * 0.1)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements)
    optim.step()
    optim.zero_grad()


def _digest(t: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    full = t.full_tensor() if isinstance(t, DTensor) else t
    return f"{full.dtype}{list(full.shape)}:" + hashlib.sha256(full.contiguous().numpy().tobytes()).hexdigest()


def fingerprint(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """Every full tensor's digest, keyed by name (optimizer state by parameter FQN), and
    the optimizer's hyperparameters: equal fingerprints are equal states, on any world size."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = {f"model.{k}": _digest(v) for k, v in model.state_dict().items()}
    osd = get_optimizer_state_dict(model, optim)
    for fqn, entries in sorted(osd["state"].items()):
        for key, value in sorted(entries.items()):
            out[f"optim.{fqn}.{key}"] = _digest(value) if isinstance(value, torch.Tensor) else value
    out["optim.param_groups"] = json.dumps(osd["param_groups"], sort_keys=True, default=str)
    return out


def _config(workdir: Path) -> dict:
    return json.loads((workdir / "config.json").read_text())


def _restore_each(ck, world: int, steps) -> dict:
    """Restore each step into a blank model and fresh optimizer: its fingerprint, its tier."""
    out = {}
    for step in steps:
        model, optim = sharded(world, blank=True)
        state = {"model": model, "optim": optim, "progress": {"step": None}}
        result = ck.restore(state, step=step)
        out[str(step)] = {
            "step": result.step,
            "tier": result.tier,
            "skipped": result.skipped,
            "progress": state["progress"]["step"],
            "fingerprint": fingerprint(model, optim),
        }
    return out


def save_and_restore(rank: int, world: int, workdir: Path) -> dict:
    """Save steps 1-4 concurrently from every rank (sync and async, full and incremental),
    restore each on this world size; then rank 0 archives step 4 to the second bucket and
    expires it from the hot one, and every rank restores it from the archive tier."""
    from ckptflow import Checkpointer, lifecycle
    from ckptflow.store import open_store

    cfg = _config(workdir)
    model, optim = sharded(world)
    local_rows = model.w.to_local().shape[0]
    saved: dict[str, dict] = {}
    with Checkpointer(cfg["hot"], run=RUN, chunk_bytes=CHUNK, threads=2) as ck:
        pending = None
        for step, kind, blocking in SAVES:
            if pending is not None:
                pending.wait()
            train(model, optim, step)
            saved[str(step)] = fingerprint(model, optim)
            state = {"model": model, "optim": optim, "progress": {"step": step}}
            pending = ck.save(step, state, kind=kind, blocking=blocking)
            if not blocking:  # training goes on while the save uploads: it must have snapshotted
                train(model, optim, 100 + step)
            else:
                pending = None
        if pending is not None:
            pending.wait()
        restored = _restore_each(ck, world, [s for s, _, _ in SAVES])

    dist.barrier()
    if rank == 0:
        hot, archive = open_store(cfg["hot"]), open_store(cfg["archive"])
        report = lifecycle.archive(hot, archive, RUN, ARCHIVED)
        assert report.ok, report.problems
        lifecycle.expire(hot, RUN, ARCHIVED, keep_records=True)
    dist.barrier()
    with Checkpointer(cfg["hot"], run=RUN, tiers=[cfg["archive"]], threads=2) as ck:
        hot_steps = [i.step for i in ck.list()]
        model, optim = sharded(world, blank=True)
        latest = ck.restore({"model": model, "optim": optim, "progress": {"step": None}})
        from_archive = {"step": latest.step, "tier": latest.tier, "fingerprint": fingerprint(model, optim)}
    return {
        "rank": rank,
        "local_rows": local_rows,
        "saved": saved,
        "restored": restored,
        "hot_steps_after_expiry": hot_steps,
        "from_archive": from_archive,
    }


def restore_resharded(rank: int, world: int, workdir: Path) -> dict:
    """On another world size: every step the bigger job saved, step 4 from the archive tier."""
    from ckptflow import Checkpointer

    cfg = _config(workdir)
    model, _ = sharded(world, blank=True)
    with Checkpointer(cfg["hot"], run=RUN, tiers=[cfg["archive"]], threads=2) as ck:
        restored = _restore_each(ck, world, [s for s, _, _ in SAVES])
    return {"rank": rank, "local_rows": model.w.to_local().shape[0], "restored": restored}


SCENARIOS = {"save_and_restore": save_and_restore, "restore_resharded": restore_resharded}
