"""Rank bodies where the ranks see different things (run by ``dist_workers.launch``):
different step times under an adaptive policy, an error on one rank only. Each returns
what its rank saw; a rank left waiting in a collective is killed at the launch's deadline."""

from __future__ import annotations

import time
from pathlib import Path

import torch

RUN = "ranks"


def adaptive_slow_rank(rank: int, world: int, workdir: Path) -> dict:
    """Rank 1's steps take 25x longer: each rank measures other step times."""
    from ckptflow import Checkpointer, SavePolicy

    state = {"w": torch.full((64,), float(rank))}
    policy = SavePolicy.adaptive(max_overhead=0.5, initial_every=2, mtbf_s=0.5, full_every=3)
    saved = []
    with Checkpointer(str(workdir / "store"), run=RUN, policy=policy, threads=2) as ck:
        for step in range(1, 30):
            time.sleep(0.002 if rank == 0 else 0.05)
            state["w"] += 1
            if ck.save(step, state, blocking=step % 2 == 0) is not None:
                saved.append(step)
    return {"rank": rank, "saved": saved}


def adaptive_after_a_group_of_rank_0_alone(rank: int, world: int, workdir: Path) -> dict:
    """The job made a group only rank 0 is in (every rank called ``new_group``, as torch
    asks), then an adaptive Checkpointer on every rank: its agreeing group must be named
    alike on each."""
    import torch.distributed as dist

    from ckptflow import Checkpointer, SavePolicy

    dist.new_group([0], backend="gloo")
    state = {"w": torch.full((64,), float(rank))}
    policy = SavePolicy.adaptive(max_overhead=0.5, initial_every=1, mtbf_s=0.5)
    started = time.monotonic()
    with Checkpointer(str(workdir / "store"), run=RUN, policy=policy, threads=2) as ck:
        saved = [step for step in (1, 2) if ck.save(step, state, kind="full") is not None]
    return {"rank": rank, "saved": saved, "took_s": time.monotonic() - started}


class _Loader:
    """A data loader whose state cannot be taken on ``failing_rank``."""

    def __init__(self, rank: int, failing_rank: int | None):
        self.rank, self.failing_rank = rank, failing_rank

    def state_dict(self) -> dict:
        if self.rank == self.failing_rank:
            raise RuntimeError(f"no state on rank {self.rank}")
        return {"position": 7}

    def load_state_dict(self, state: dict) -> None:
        pass


def state_dict_raises_on_one_rank(rank: int, world: int, workdir: Path) -> dict:
    """Rank 1's loader raises in ``state_dict()``; then the ranks save again, all sound."""
    from ckptflow import Checkpointer

    with Checkpointer(str(workdir / "store"), run=RUN, threads=2) as ck:
        started = time.monotonic()
        try:
            ck.save(1, {"w": torch.ones(8), "loader": _Loader(rank, failing_rank=1)})
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        refused_s = time.monotonic() - started
        ck.save(1, {"w": torch.ones(8), "loader": _Loader(rank, failing_rank=None)})
        steps = [info.step for info in ck.list()]
    return {"rank": rank, "error": error, "refused_s": refused_s, "steps": steps}


def delta_base_unlisted_on_rank_0(rank: int, world: int, workdir: Path) -> dict:
    """codec="auto", a resumed job's first incremental save: rank 0 cannot list the fulls."""
    import torch.distributed as dist

    from ckptflow import Checkpointer
    from ckptflow.dcp import auto_codec
    from ckptflow.errors import StoreUnavailableError

    root = str(workdir / "store")
    state = {"w": torch.arange(256, dtype=torch.float32) + rank}
    with Checkpointer(root, run=RUN, codec="auto", threads=2) as ck:
        ck.save(1, state)
    dist.barrier()
    if rank == 0:

        def outage(*args: object, **kwargs: object) -> None:
            raise StoreUnavailableError("listing the checkpoints failed after 10 attempts")

        auto_codec.newest_full = outage  # type: ignore[assignment]
    started = time.monotonic()
    with Checkpointer(root, run=RUN, codec="auto", threads=2) as ck:
        ck.save(2, state, kind="incremental")
        took = time.monotonic() - started
        kinds = [(info.step, info.kind) for info in ck.list()]
    return {"rank": rank, "took_s": took, "kinds": kinds}


def prepare_during_async_save(rank: int, world: int, workdir: Path) -> dict:
    """``prepare`` called while an async save is in flight, whose writes are slow on rank 1."""
    from ckptflow import Checkpointer
    from ckptflow.chunks.io import ChunkStore

    if rank == 1:
        put = ChunkStore.put

        def slow_put(self: ChunkStore, *args: object, **kwargs: object) -> object:
            time.sleep(0.3)
            return put(self, *args, **kwargs)

        ChunkStore.put = slow_put  # type: ignore[method-assign]
    state = {"w": torch.ones(1024) * rank}
    with Checkpointer(str(workdir / "store"), run=RUN, threads=2, pack_bytes=0, chunk_bytes=1024) as ck:
        handle = ck.save(1, state, blocking=False)
        ck.prepare(state)
        assert handle is not None
        handle.wait()
        return {"rank": rank, "steps": [info.step for info in ck.list()]}


def _a_bug(*args: object, **kwargs: object) -> None:
    raise TypeError("a bug on rank 0")


def _timed(call) -> tuple[str | None, float]:
    """(the error ``call`` raised, as "Type: message", or None; the seconds it took)."""
    started = time.monotonic()
    try:
        call()
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return error, time.monotonic() - started


def unexpected_errors_on_rank_0(rank: int, world: int, workdir: Path) -> dict:
    """A bug's exception (not ckptflow's) on rank 0 where rank 0 alone decides: whether the
    step is free, the base of an incremental save's deltas, which checkpoint to restore."""
    from ckptflow import Checkpointer
    from ckptflow.catalog import selection
    from ckptflow.dcp import auto_codec
    from ckptflow.training import save_preflight

    root = str(workdir / "store")
    state = {"w": torch.arange(256, dtype=torch.float32) + rank}
    with Checkpointer(root, run=RUN, codec="auto", threads=2) as ck:
        ck.save(1, state)
    errors, took = {}, {}
    with Checkpointer(root, run=RUN, codec="auto", threads=2) as ck:  # a new one lists the store for its delta base
        for name, module, attr, call in [
            ("delta_base", auto_codec, "newest_full", lambda: ck.save(2, state, kind="incremental")),
            ("claim_step", save_preflight, "check_step", lambda: ck.save(2, state)),
            ("restore", selection, "choose", lambda: ck.restore(state)),
        ]:
            original = getattr(module, attr)
            if rank == 0:
                setattr(module, attr, _a_bug)
            try:
                errors[name], took[name] = _timed(call)
            finally:
                setattr(module, attr, original)
        ck.save(2, state)
        steps = [info.step for info in ck.list()]
    return {"rank": rank, "errors": errors, "took_s": took, "steps": steps}


def ranks_ask_for_different_saves(rank: int, world: int, workdir: Path) -> dict:
    """Rank 1 is one step ahead of rank 0 (its own step counter), then asks for another kind
    of save than rank 0; then both ask alike."""
    from ckptflow import Checkpointer, per_rank

    state = {"own": per_rank({"w": torch.full((64,), float(rank))})}
    errors, took = {}, {}
    with Checkpointer(str(workdir / "store"), run=RUN, threads=2) as ck:
        for name, call in [
            ("step", lambda: ck.save(5 + rank, state)),
            ("kind", lambda: ck.save(8, state, kind="full" if rank == 0 else "incremental")),
        ]:
            errors[name], took[name] = _timed(call)
            if name == "step":
                committed = [info.step for info in ck.list()]
                ck.save(4, state)  # a base: the incremental save asked for next has one
        if errors["kind"] is not None:  # else step 8 is committed already
            ck.save(8, state, kind="incremental")
        steps = [(info.step, info.kind) for info in ck.list()]
        restored = {"own": per_rank({"w": torch.zeros(64)})}
        ck.restore(restored)
    return {
        "rank": rank,
        "errors": errors,
        "took_s": took,
        "committed": committed,
        "steps": steps,
        "restored": restored["own"].value["w"].tolist() == state["own"].value["w"].tolist(),
    }


def every_rank_fails_to_write(rank: int, world: int, workdir: Path) -> dict:
    """The store is down for every rank while a save writes its chunks (blocking, then async);
    then rank 0 finds the store down and rank 1 finds it full; then rank 1 alone finds it down
    (blocking, then async), after which the coordinator's lease, held since planning for its
    commit, must be given back (``leases_left``: live leases 5 s on); then it is back."""
    from ckptflow import Checkpointer, per_rank
    from ckptflow.chunks import lease_listing
    from ckptflow.chunks.io import ChunkStore
    from ckptflow.errors import StoreFullError, StoreUnavailableError

    def failing(error: Exception):
        def put(self: ChunkStore, *args: object, **kwargs: object) -> object:
            raise error

        return put

    state = {"own": per_rank({"w": torch.full((4096,), float(rank))})}
    outage = StoreUnavailableError(f"rank {rank}: the store is down (after 10 attempts)")
    full = StoreFullError(f"rank {rank}: no space left on the device")
    errors, leases_left = {}, {}
    original = ChunkStore.put
    with Checkpointer(str(workdir / "store"), run=RUN, threads=2, pack_bytes=0, chunk_bytes=1024) as ck:
        for name, error, blocking in [
            ("blocking", outage, True),
            ("async", outage, False),
            ("mixed", outage if rank == 0 else full, True),
            ("rank 1 alone", outage if rank == 1 else None, True),
            ("rank 1 alone, async", outage if rank == 1 else None, False),
        ]:
            if error is not None:
                ChunkStore.put = failing(error)  # type: ignore[method-assign]
            try:
                handle = ck.save(1, state, blocking=blocking)
                if not blocking:
                    assert handle is not None
                    handle.wait()
                errors[name] = None
            except Exception as e:  # what a loop that goes on after a failed save catches
                errors[name] = [type(e).__name__, str(e), "\n".join(getattr(e, "__notes__", []))]
            finally:
                ChunkStore.put = original  # type: ignore[method-assign]
            deadline = time.monotonic() + 5
            while (live := len(lease_listing.leases(ck.store).live)) and time.monotonic() < deadline:
                time.sleep(0.05)
            leases_left[name] = live
        ck.save(1, state)
        steps = [info.step for info in ck.list()]
    return {"rank": rank, "errors": errors, "steps": steps, "leases_left": leases_left}


def save_waits_as_long_as_the_job(rank: int, world: int, workdir: Path) -> dict:
    """The job's collectives time out after 3 s, and rank 1 never saves: rank 0's save must
    fail once those 3 s pass, not after torch's default of 30 minutes."""
    from datetime import timedelta

    import torch.distributed as dist

    from ckptflow import Checkpointer
    from ckptflow.dcp.collectives import job_timeout

    given = job_timeout()  # the workers' init_process_group(timeout=40 s)
    dist.distributed_c10d._set_pg_timeout(dist.default_pg_timeout)  # as if the job gave none
    unset = job_timeout()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=3))  # what init_process_group(timeout=) sets
    done = workdir / "rank-0-done"
    result: dict = {"rank": rank, "given_s": given and given.total_seconds(), "unset": unset}
    with Checkpointer(str(workdir / "store"), run=RUN, threads=2) as ck:
        if rank == 0:
            started = time.monotonic()
            try:
                ck.save(1, {"w": torch.ones(8)})
                result["error"] = None
            except Exception as e:
                result["error"] = f"{type(e).__name__}: {e}"
            result["took_s"] = time.monotonic() - started
            done.touch()
        else:
            deadline = time.monotonic() + 60
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    return result


SCENARIOS = {
    "unexpected_errors_on_rank_0": unexpected_errors_on_rank_0,
    "save_waits_as_long_as_the_job": save_waits_as_long_as_the_job,
    "ranks_ask_for_different_saves": ranks_ask_for_different_saves,
    "every_rank_fails_to_write": every_rank_fails_to_write,
    "prepare_during_async_save": prepare_during_async_save,
    "delta_base_unlisted_on_rank_0": delta_base_unlisted_on_rank_0,
    "adaptive_slow_rank": adaptive_slow_rank,
    "adaptive_after_a_group_of_rank_0_alone": adaptive_after_a_group_of_rank_0_alone,
    "state_dict_raises_on_one_rank": state_dict_raises_on_one_rank,
}
