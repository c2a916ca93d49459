"""Rank bodies where the ranks see different things while restoring (run by
``dist_workers.launch``): damage on one rank and a failed read on the other, a checkpoint
read back with another sharding than it was saved with. Each returns what its rank saw."""

from __future__ import annotations

from pathlib import Path

import torch

from support import dist_workers as W


def fail_reads(store, keys: str = "chunks/") -> None:
    """Every read of a key under ``keys`` from ``store`` fails as an unreachable disk does."""

    def failing(method):
        def call(key, *args, **kwargs):
            if key.startswith(keys):
                raise OSError(5, "Input/output error (injected)", key)
            return method(key, *args, **kwargs)

        return call

    for name in ("get", "get_bounded", "get_into", "scan", "get_versioned", "stat"):
        setattr(store, name, failing(getattr(store, name)))


def outage_on_one_rank_damage_on_the_other(rank: int, world: int, workdir: Path) -> dict:
    """Steps 1-2 saved; a chunk of step 2 only rank 1 reads is damaged, and every chunk read
    on rank 0 fails (an outage). Nothing proves step 2 whole on rank 0: every rank must stop
    with StoreUnavailableError, none may fall back to step 1."""
    import torch.distributed as dist

    from ckptflow import Checkpointer
    from ckptflow.format import layout as fmt

    mesh = W._mesh(world)
    root = workdir / "store"
    ck = Checkpointer(str(root), run=W.RUN, chunk_bytes=W.CHUNK, threads=2)
    for step in (1, 2):
        ck.save(step, W._sharded_state(mesh, step), kind="full")
    dist.barrier()
    if rank == 0:
        W.corrupt_rank_only_chunk(root, fmt, step=2, owner_rank=1, world=world)
    dist.barrier()
    reader = Checkpointer(str(root), run=W.RUN, chunk_bytes=W.CHUNK, threads=2)
    if rank == 0:
        fail_reads(reader.store)
    state = W._blank_sharded_state(mesh)
    try:
        result = reader.restore(state)
        outcome = {"step": result.step, "skipped": result.skipped, "error": None}
    except Exception as e:
        outcome = {"step": None, "error": type(e).__name__, "message": str(e)}
    untouched = bool((state["w"].to_local() == -1).all()) and bool((state["rep"] == -1).all())
    ck.close()
    reader.close()
    return {"rank": rank, **outcome, "untouched": untouched}


def _meshed(mesh, tensor: torch.Tensor, dim: int):
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(tensor, mesh, [Shard(dim)])


def resharded(rank: int, world: int, workdir: Path) -> dict:
    """Saved sharded by rows, restored sharded by columns (and replicated) on the same ranks,
    with a restore buffer small enough that staging is flushed between items."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from ckptflow import Checkpointer

    mesh = W._mesh(world)
    root = str(workdir / "store")
    with Checkpointer(root, run=W.RUN, chunk_bytes=W.CHUNK, threads=2) as ck:
        ck.save(1, {"w": _meshed(mesh, W.full_weight(1), 0), "v": _meshed(mesh, W.full_weight(3).T.contiguous(), 1)})
    out: dict = {"rank": rank}
    with Checkpointer(root, run=W.RUN, chunk_bytes=W.CHUNK, threads=2, restore_buffer_bytes=1 << 20) as ck:
        state = {"w": _meshed(mesh, torch.zeros(W.ROWS, W.COLS), 1), "v": _meshed(mesh, torch.zeros(W.COLS, W.ROWS), 0)}
        out["cols_step"] = ck.restore(state).step
        out["cols_w"] = bool(torch.equal(state["w"].full_tensor(), W.full_weight(1)))
        out["cols_v"] = bool(torch.equal(state["v"].full_tensor(), W.full_weight(3).T))
        rep = {
            "w": distribute_tensor(torch.zeros(W.ROWS, W.COLS), mesh, [Replicate()]),
            "v": distribute_tensor(torch.zeros(W.COLS, W.ROWS), mesh, [Replicate()]),
        }
        ck.restore(rep)
        out["rep_w"] = bool(torch.equal(rep["w"].to_local(), W.full_weight(1)))
        out["rep_v"] = bool(torch.equal(rep["v"].to_local(), W.full_weight(3).T))
    return out


def specific_damaged_step(rank: int, world: int, workdir: Path) -> dict:
    """step=2 asked for, and a chunk of it only rank 1 reads is damaged: every rank raises
    NoValidCheckpointError naming step 2, none loads step 1 or 3."""
    import torch.distributed as dist

    from ckptflow import Checkpointer
    from ckptflow.format import layout as fmt

    mesh = W._mesh(world)
    root = workdir / "store"
    ck = Checkpointer(str(root), run=W.RUN, chunk_bytes=W.CHUNK, threads=2)
    for step in (1, 2, 3):
        ck.save(step, W._sharded_state(mesh, step), kind="full")
    dist.barrier()
    if rank == 0:
        W.corrupt_rank_only_chunk(root, fmt, step=2, owner_rank=1, world=world)
    dist.barrier()
    state = W._blank_sharded_state(mesh)
    try:
        result = ck.restore(state, step=2)
        outcome = {"step": result.step, "error": None}
    except Exception as e:
        outcome = {"step": None, "error": type(e).__name__, "message": str(e)}
    untouched = bool((state["w"].to_local() == -1).all())
    ck.close()
    return {"rank": rank, **outcome, "untouched": untouched}


def step_committed_again_between_the_ranks_reads(rank: int, world: int, workdir: Path) -> dict:
    """Step 2 committed twice: A (the values of step 2), then B (of step 20), both whole. Rank 0's
    first read of the commit record returns A, as if it read just before B replaced it; rank 1
    reads B. Then ("always") every read of rank 0 returns A."""
    import shutil

    import torch.distributed as dist

    from ckptflow import Checkpointer
    from ckptflow.catalog.checkpoints import read_manifest
    from ckptflow.format import layout as fmt
    from ckptflow.store.local import LocalStore

    mesh = W._mesh(world)
    earlier, root = workdir / "earlier", workdir / "store"
    for where, values in ((earlier, 2), (root, 20)):
        with Checkpointer(str(where), run=W.RUN, chunk_bytes=W.CHUNK, threads=2) as ck:
            ck.save(2, W._sharded_state(mesh, values), kind="full")
    dist.barrier()
    step_dir = fmt.step_prefix(W.RUN, 2)
    if rank == 0:  # A's rank records and chunks are in the store too, as they were before B replaced it
        shutil.copytree(earlier / "chunks", root / "chunks", dirs_exist_ok=True)
        shutil.copytree(earlier / step_dir / "ranks", root / step_dir / "ranks", dirs_exist_ok=True)
    dist.barrier()

    class EarlierCommitFirst(LocalStore):
        def __init__(self, reads: int):
            super().__init__(str(root))
            self.reads = reads  # how many reads of the commit record return A's

        def get_bounded(self, key, limit):
            if key == fmt.manifest_key(W.RUN, 2) and self.reads > 0:
                self.reads -= 1
                return (earlier / key).read_bytes()
            return super().get_bounded(key, limit)

    out: dict = {"rank": rank, "b_digest": read_manifest(LocalStore(str(root)), W.RUN, 2).digest}
    for case, reads in (("once", 1), ("always", 1000)):
        store = EarlierCommitFirst(reads if rank == 0 else 0)
        state = W._blank_sharded_state(mesh)
        with Checkpointer(store, run=W.RUN, chunk_bytes=W.CHUNK, threads=2) as ck:
            try:
                result = ck.restore(state)
                outcome = {"digest": result.digest, "epoch": state["epoch"], "error": None}
                outcome["w_is_b"] = bool(torch.equal(state["w"].full_tensor(), W.full_weight(20)))
            except Exception as e:
                outcome = {"error": type(e).__name__, "message": str(e)}
        outcome["untouched"] = bool((state["w"].to_local() == -1).all())
        out[case] = {**outcome, "earlier_reads": reads - store.reads if rank == 0 else 0}
    return out


SCENARIOS = {
    "outage_on_one_rank_damage_on_the_other": outage_on_one_rank_damage_on_the_other,
    "resharded": resharded,
    "specific_damaged_step": specific_damaged_step,
    "step_committed_again_between_the_ranks_reads": step_committed_again_between_the_ranks_reads,
}


def _model():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def _train(model, opt, sched, steps, start):
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, 6, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def fsdp_to_one(rank: int, world: int, workdir: Path) -> dict:
    """A model fully_shard-ed over 2 ranks, AdamW and a scheduler, trained 3 steps and saved;
    the caller restores it into one process and trains on."""
    from torch.distributed.fsdp import fully_shard

    from ckptflow import Checkpointer

    model = _model()
    fully_shard(model, mesh=W._mesh(world))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    _train(model, opt, sched, 3, 0)
    with Checkpointer(str(workdir / "store"), run=W.RUN, threads=2) as ck:
        ck.save(3, {"model": model, "optim": opt, "sched": sched})
        model2 = _model()
        fully_shard(model2, mesh=W._mesh(world))
        opt2 = torch.optim.AdamW(model2.parameters(), lr=0.05)
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
        ck.restore({"model": model2, "optim": opt2, "sched": sched2})
    _train(model, opt, sched, 3, 3)
    _train(model2, opt2, sched2, 3, 3)
    full = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
    full2 = {k: v.full_tensor().tolist() for k, v in model2.state_dict().items()}
    return {"rank": rank, "same_after_resume": full == full2, "full": full}


SCENARIOS["fsdp_to_one"] = fsdp_to_one


def state_mismatch_on_one_rank(rank: int, world: int, workdir: Path) -> dict:
    """Steps 1-2 saved; rank 1 restores into a state with a tensor ``extra`` the checkpoint
    lacks, rank 0 into the state saved. Every rank raises StateMismatchError, and rank 0,
    whose own state fits, must learn which rank's did not and at which key."""
    import torch.distributed as dist

    from ckptflow import Checkpointer

    mesh = W._mesh(world)
    root = workdir / "store"
    with Checkpointer(str(root), run=W.RUN, chunk_bytes=W.CHUNK, threads=2) as ck:
        for step in (1, 2):
            ck.save(step, W._sharded_state(mesh, step), kind="full")
    dist.barrier()
    state = W._blank_sharded_state(mesh)
    if rank == 1:
        state["extra"] = torch.zeros(3)
    with Checkpointer(str(root), run=W.RUN, chunk_bytes=W.CHUNK, threads=2) as reader:
        try:
            outcome = {"step": reader.restore(state).step, "error": None}
        except Exception as e:
            outcome = {"step": None, "error": type(e).__name__, "message": str(e)}
    return {"rank": rank, **outcome, "untouched": bool((state["w"].to_local() == -1).all())}


SCENARIOS["state_mismatch_on_one_rank"] = state_mismatch_on_one_rank
