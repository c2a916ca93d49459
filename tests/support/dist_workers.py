"""Rank bodies for dcp/test_distributed.py, run in processes forked from a clean server.

``launch(scenarios, workdir, world)`` starts one process per rank; each joins a gloo
process group on 127.0.0.1, runs ``SCENARIOS[scenario](rank, world_size, workdir)`` for each
scenario in turn (``SCENARIOS`` of this module, or of the module named by ``registry``) and
writes its JSON result (or its traceback) to ``workdir``. Failures in any child fail the
test with that child's traceback; a rank that hangs is killed at the deadline.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

RUN = "dist"
ROWS, COLS = 9, 5  # 9 rows over 2 ranks: uneven shards (5 + 4)
CHUNK = 32  # bytes: every shard spans several chunks


# ---- deterministic data -------------------------------------------------------------------
def full_weight(step: int) -> torch.Tensor:
    return (torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1) * step


def replicated(step: int) -> torch.Tensor:
    return torch.linspace(0, 1, 13, dtype=torch.float64) + step


def shard_rows(rank: int, world: int) -> tuple[int, int]:
    """The rows Shard(0) gives ``rank`` (torch.chunk semantics)."""
    per = -(-ROWS // world)
    start = min(rank * per, ROWS)
    return start, min(start + per, ROWS)


def seed_rank(rank: int) -> None:
    random.seed(1000 + rank)
    np.random.seed(1000 + rank)
    torch.manual_seed(1000 + rank)


def draws() -> list:
    return [random.random(), float(np.random.rand()), torch.rand(3).tolist()]


# ---- scenarios (run on every rank) ----------------------------------------------------------
def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _sharded_state(mesh, step: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        "w": distribute_tensor(full_weight(step), mesh, [Shard(0)]),
        "rep": replicated(step),
        "epoch": step,
    }


def _blank_sharded_state(mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        "w": distribute_tensor(torch.full((ROWS, COLS), -1.0), mesh, [Shard(0)]),
        "rep": torch.full((13,), -1.0, dtype=torch.float64),
        "epoch": None,
    }


def _check_local(state: dict, rank: int, world: int, step: int) -> dict:
    lo, hi = shard_rows(rank, world)
    local = state["w"].to_local()
    return {
        "w_local_ok": bool(torch.equal(local, full_weight(step)[lo:hi])),
        "w_full_ok": bool(torch.equal(state["w"].full_tensor(), full_weight(step))),
        "local_rows": list(local.shape),
        "rep_ok": bool(torch.equal(state["rep"], replicated(step))),
        "epoch": state["epoch"],
    }


def save_sharded(rank: int, world: int, workdir: Path) -> dict:
    """Save a DTensor-sharded state + a replicated tensor on every rank; restore it, RNG too."""
    from ckptflow import Checkpointer

    mesh = _mesh(world)
    ck = Checkpointer(str(workdir / "store"), run=RUN, chunk_bytes=CHUNK, threads=2)
    seed_rank(rank)
    saved = ck.save(1, _sharded_state(mesh, 1))
    expected_draws = draws()  # what this rank draws next, as captured by the save
    consumed = draws() + draws()  # training moves the RNG on
    state = _blank_sharded_state(mesh)
    result = ck.restore(state)
    after = draws()

    # An async save must snapshot the tensors before it returns: training goes on at once.
    live = _sharded_state(mesh, 2)
    handle = ck.save(2, live, blocking=False)
    with torch.no_grad():
        live["w"].to_local().fill_(-5.0)
        live["rep"].fill_(-5.0)
    async_info = handle.wait().info is not None
    state2 = _blank_sharded_state(mesh)
    result2 = ck.restore(state2)
    ck.close()
    return {
        "rank": rank,
        "async_step": result2.step,
        "async_info": async_info,
        "async": _check_local(state2, rank, world, 2),
        "coordinator_info": saved.info is not None,
        "step": result.step,
        "skipped": result.skipped,
        "rng_restored": result.rng_restored,
        "expected_draws": expected_draws,
        "draws_after_restore": after,
        "consumed": consumed,
        **_check_local(state, rank, world, 1),
    }


def load_sharded(rank: int, world: int, workdir: Path) -> dict:
    """Restore a checkpoint (written by one process) into DTensor shards."""
    from ckptflow import Checkpointer

    mesh = _mesh(world)
    state = _blank_sharded_state(mesh)
    ck = Checkpointer(str(workdir / "store"), run=RUN, chunk_bytes=CHUNK, threads=2)
    result = ck.restore(state)
    ck.close()
    return {
        "rank": rank,
        "step": result.step,
        "skipped": result.skipped,
        "rng_restored": result.rng_restored,
        **_check_local(state, rank, world, result.step),
    }


def restore_agreement(rank: int, world: int, workdir: Path) -> dict:
    """Steps 1-3 saved; then damage that only rank 1 can see.

    Step 3: a chunk that only step 3 uses and only rank 1 reads (its shard of ``w``) is
    corrupted (found while DCP loads). Step 2: rank 1's rank record is corrupted (found
    before any collective load starts). Both ranks must skip 3 and 2 and load step 1.
    """
    import torch.distributed as dist

    from ckptflow import Checkpointer
    from ckptflow.format import layout as fmt

    mesh = _mesh(world)
    root = workdir / "store"
    ck = Checkpointer(str(root), run=RUN, chunk_bytes=CHUNK, threads=2)
    for step in (1, 2, 3):
        ck.save(step, _sharded_state(mesh, step), kind="full" if step == 1 else "incremental")
    dist.barrier()
    box = [None]
    if rank == 0:
        box[0] = corrupt_rank_only_chunk(root, fmt, step=3, owner_rank=1, world=world)
        save_id = json.loads((root / fmt.manifest_key(RUN, 2)).read_bytes())["save_id"]
        record = root / fmt.rank_key(RUN, 2, 1, save_id)
        blob = bytearray(record.read_bytes())
        blob[blob.index(b'"rank":1') + 7] = ord("7")  # still JSON, fails its checksum
        record.write_bytes(bytes(blob))
    dist.broadcast_object_list(box, src=0)
    dist.barrier()
    state = _blank_sharded_state(mesh)
    result = ck.restore(state)
    verify = {step: ck.verify(step).ok for step in (1, 2, 3)}
    ck.close()
    return {
        "rank": rank,
        "corrupted": box[0],
        "step": result.step,
        "skipped": result.skipped,
        "verify": verify,
        **_check_local(state, rank, world, result.step),
    }


def corrupt_rank_only_chunk(root: Path, fmt, step: int, owner_rank: int, world: int) -> str:
    """Flip a byte in a chunk that holds only ``owner_rank``'s rows of ``w`` and that no
    other checkpoint or item uses."""
    manifests = {
        int(p.parent.name): json.loads(p.read_bytes())
        for p in (root / "runs" / RUN / "checkpoints").glob("*/manifest.json")
    }
    lo, _hi = shard_rows(owner_rank, world)
    owned, others = set(), set()
    for s, m in manifests.items():
        if s != step:
            others |= set(m["chunks"])
    for item in manifests[step]["dcp"]["items"]:
        digests = {d for d, _ in item["chunks"]}
        if item["fqn"] == "w" and item["offset"] == [lo, 0]:
            owned |= digests
        else:
            others |= digests
    candidates = sorted(owned - others)
    assert candidates, f"no chunk of step {step} belongs to rank {owner_rank} alone"
    digest = candidates[0]
    path = root / fmt.chunk_key(digest)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    path.write_bytes(bytes(blob))
    return digest


def per_rank_values(rank: int, world: int, workdir: Path) -> dict:
    """Each rank saves step 1 holding its own values (rank + 1) twice, wrapped in ``per_rank``
    and as a plain tensor of one name, restores both into zeros and returns what it got
    back. DCP keeps one copy of a plain tensor every rank saves under one name (that of the
    rank whose plan is smallest then, not necessarily rank 0's) and every rank gets that
    copy; ``per_rank`` stores each rank's own, and each rank gets its own back."""
    from ckptflow import Checkpointer, per_rank

    root = workdir / "store"
    own = torch.full((3,), float(rank + 1))
    with Checkpointer(str(root), run=RUN, threads=2) as ck:
        ck.save(1, {"stats": per_rank({"mean": own.clone()}), "plain": own.clone()})
        state = {"stats": per_rank({"mean": torch.zeros(3)}), "plain": torch.zeros(3)}
        ck.restore(state)
    return {"rank": rank, "per_rank": state["stats"].value["mean"].tolist(), "plain": state["plain"].tolist()}


def drifting_weight(step: int) -> torch.Tensor:
    """A weight that moves a little per step: codec "auto" stores its changes as deltas."""
    base = torch.randn(DRIFT_ROWS, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    return base * (1 + 1e-4 * step)


def save_sharded_auto(rank: int, world: int, workdir: Path) -> dict:
    """codec="auto" on every rank: each rank's incremental chunks become deltas on its own
    shard's chunks of the full; restore brings back the exact shards."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptflow import Checkpointer
    from ckptflow.catalog import checkpoints as catalog

    mesh = _mesh(world)
    ck = Checkpointer(str(workdir / "store"), run=RUN, codec="auto", chunk_bytes=DRIFT_CHUNK, threads=2)
    ck.save(1, {"w": distribute_tensor(drifting_weight(1), mesh, [Shard(0)])}, kind="full")
    ck.save(2, {"w": distribute_tensor(drifting_weight(2), mesh, [Shard(0)])}, kind="incremental")
    state = {"w": distribute_tensor(torch.zeros(DRIFT_ROWS, 64), mesh, [Shard(0)])}
    result = ck.restore(state)
    manifest = catalog.read_manifest(ck.store, RUN, 2)
    ck.close()
    return {
        "step": result.step,
        "w_full_ok": bool(torch.equal(state["w"].full_tensor(), drifting_weight(2))),
        "bases": len(manifest.bases),
        "chunks": len(manifest.chunks),
    }


DRIFT_ROWS, DRIFT_CHUNK = 512, 16 << 10  # two 64 KiB shards of four chunks each

SCENARIOS = {
    "save_sharded": save_sharded,
    "load_sharded": load_sharded,
    "restore_agreement": restore_agreement,
    "per_rank_values": per_rank_values,
    "save_sharded_auto": save_sharded_auto,
}


# ---- process plumbing ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    registry: str, scenarios: list[str], rank: int, world: int, port: int, workdir: str, environ: dict[str, str]
) -> None:
    import importlib

    import torch.distributed as dist

    os.environ.clear()  # the launching test's environment (an S3 endpoint's credentials), not the fork server's
    os.environ.update(environ)
    out = Path(workdir)
    torch.set_num_threads(1)
    current = "init_process_group"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=40),
        )
        for current in scenarios:
            sub = out / current
            sub.mkdir(exist_ok=True)
            result = importlib.import_module(registry).SCENARIOS[current](rank, world, sub)
            tmp = out / f"result-{current}-{rank}.json.tmp"
            tmp.write_text(json.dumps(result))
            os.replace(tmp, out / f"result-{current}-{rank}.json")
            dist.barrier()
        current = "destroy_process_group"
        dist.destroy_process_group()
    except BaseException:
        (out / f"error-{rank}.txt").write_text(f"in {current}:\n{traceback.format_exc()}")
        os._exit(1)  # do not wait on peers stuck in a collective


class Session:
    """Results of one spawned group of ranks that ran several scenarios in turn."""

    def __init__(self, workdir: Path, scenarios: list[str], world: int, errors: dict[int, str], note: str):
        self.workdir, self.scenarios, self.world, self.errors, self.note = workdir, scenarios, world, errors, note

    def results(self, scenario: str) -> list[dict]:
        """Every rank's result of ``scenario``; fails with the children's tracebacks if any is missing."""
        paths = [self.workdir / f"result-{scenario}-{r}.json" for r in range(self.world)]
        if all(p.exists() for p in paths):
            return [json.loads(p.read_text()) for p in paths]
        detail = "\n".join(f"---- rank {r} ----\n{tb}" for r, tb in sorted(self.errors.items()))
        raise AssertionError(f"scenario {scenario!r} gave no result on every rank ({self.note}):\n{detail}")


def launch(
    scenarios: list[str], workdir: Path, world: int = 2, timeout: float = 60.0, registry: str = __name__
) -> Session:
    """Run ``scenarios`` (names in ``registry``'s ``SCENARIOS``) in order on ``world`` spawned
    ranks (one process group)."""
    import multiprocessing as mp

    # Each rank is forked from a server process that imported torch, DCP and ckptflow once (for
    # all the groups this test process starts): fresh processes like spawned ones, minus imports.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "ckptflow.training.checkpointer", __name__])
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry, args=(registry, list(scenarios), r, world, port, str(workdir), dict(os.environ)), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    error_files = [workdir / f"error-{r}.txt" for r in range(world)]
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(f.exists() for f in error_files):
                time.sleep(1.0)  # give peers a moment to report their own failure
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    errors = {r: f.read_text() for r, f in enumerate(error_files) if f.exists()}
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    note = f"exit codes {codes}" + (f"; killed at the {timeout:.0f}s deadline" if time.monotonic() >= deadline else "")
    return Session(workdir, list(scenarios), world, errors, note)
