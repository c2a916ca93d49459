#!/usr/bin/env python
"""`make soak`: SIGKILL a training job again and again, mid-save, mid-restore, mid-GC,
and check that every restore gives exactly what was saved and never something older
than what had committed.

The worker (``--worker``) restores the newest checkpoint when it starts, then loops:
sync or async, full or incremental saves (codec "auto": incremental chunks become deltas on
the newest full), a restore now and then, a GC sweep now and
then. Before each save it appends the step and the sha256 of the exact state it is
about to save to an intent log (fsynced), so a restore can be checked against what was
saved; after a save returns it prints ``committed N``. The parent kills the worker with
SIGKILL at a random moment after it started working, over and over, and reads its lines.

  wrong: a restore whose state does not hash to what was logged for its step
  stale: a restore older than the newest step the worker had reported committed

Run: ``.venv/bin/python tests/soak/soak.py --kills 200`` (``make soak``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN = "soak"
N = 1 << 17  # float32 elements per tensor: 3 tensors, 1.5 MiB a checkpoint
CHUNK = 64 << 10


# ---- the worker ----------------------------------------------------------------------------
def state_for(step: int):
    import torch

    base = torch.arange(N, dtype=torch.float32)
    frozen = torch.full((N,), 7.0)  # never changes: incremental saves dedup it
    return {"model": {"w": base + step, "frozen": frozen}, "optim": {"m": base * 0.5 - step}, "step": step}


def digest(state) -> str:
    h = hashlib.sha256()
    for t in (state["model"]["w"], state["model"]["frozen"], state["optim"]["m"]):
        h.update(t.numpy().tobytes())
    h.update(json.dumps(state["step"]).encode())
    return h.hexdigest()


def blank():
    import torch

    return {"model": {"w": torch.zeros(N), "frozen": torch.zeros(N)}, "optim": {"m": torch.zeros(N)}, "step": -1}


def say(*words) -> None:
    print(*words, flush=True)


def worker(store: str, log: Path, seed: int) -> None:
    import torch

    from ckptflow import Checkpointer, CkptflowError, NoValidCheckpointError, gc

    torch.set_num_threads(1)
    rng = random.Random(seed)
    intents = {int(line.split()[0]): line.split()[1] for line in log.read_text().splitlines()} if log.exists() else {}
    ck = Checkpointer(store, run=RUN, chunk_bytes=CHUNK, threads=2, restore_rng=False, codec="auto")  # deltas too

    def restore_and_check(phase: str) -> int:
        say("begin", phase)
        state = blank()
        try:
            step = ck.restore(state).step
        except NoValidCheckpointError:
            say("restored", -1, "none")
            return 0
        say("restored", step, "ok" if digest(state) == intents.get(step) else "WRONG")
        return step

    step = restore_and_check("restore") + 1
    say("ready")
    while True:
        roll = rng.random()
        if roll < 0.1:
            restore_and_check("restore")
            continue
        if roll < 0.2:
            say("begin", "gc")
            try:
                gc(store, grace=0, wait=5)
            except CkptflowError as e:  # a GC killed moments ago still holds its lock for 30 s
                say("gc-skipped", str(e)[:80].replace("\n", " "))
            continue
        kind = "full" if rng.random() < 0.3 else "incremental"
        blocking = rng.random() < 0.5
        state = state_for(step)
        intents[step] = digest(state)
        with log.open("a") as f:  # the intent is durable before any byte of the save is written
            f.write(f"{step} {intents[step]}\n")
            f.flush()
            os.fsync(f.fileno())
        say("begin", f"save-{'sync' if blocking else 'async'}-{kind}")
        if blocking:
            ck.save(step, state, kind=kind)
        else:
            ck.save(step, state, kind=kind, blocking=False).wait()
        say("committed", step)
        step += 1


# ---- the parent ------------------------------------------------------------------------------
def soak(kills: int, workdir: Path, seed: int) -> dict:
    rng = random.Random(seed)
    store, log = workdir / "store", workdir / "intents.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    tally: Counter = Counter()
    killed_in: Counter = Counter()
    committed = -1
    started = time.monotonic()
    for n in range(kills + 1):
        proc = subprocess.Popen([sys.executable, __file__, "--worker", str(store), str(log), str(seed + n)],
                                stdout=subprocess.PIPE, env=env)  # fmt: skip
        assert proc.stdout is not None
        phase, ready_at = "start", None
        budget = rng.uniform(0.05, 1.5)
        os.set_blocking(proc.stdout.fileno(), False)
        buffer = ""
        while True:
            if ready_at is not None and time.monotonic() - ready_at > budget and n < kills:
                proc.send_signal(signal.SIGKILL)
            try:
                buffer += os.read(proc.stdout.fileno(), 1 << 16).decode()
            except BlockingIOError:
                pass
            *lines, buffer = buffer.split("\n")
            for line in lines:
                words = line.split()
                if words[:1] == ["ready"]:
                    ready_at = time.monotonic()
                elif words[:1] == ["begin"]:
                    phase = words[1]
                elif words[:1] == ["committed"]:
                    committed = max(committed, int(words[1]))
                elif words[:1] == ["restored"]:
                    step, verdict = int(words[1]), words[2]
                    tally["restores checked"] += step >= 0
                    tally["wrong"] += verdict == "WRONG"
                    tally["stale"] += step < committed
                    if n == kills and phase == "restore":
                        proc.send_signal(signal.SIGKILL)  # the last start only restores and checks
            if proc.poll() is not None:
                break
            time.sleep(0.01)
        if proc.returncode != -signal.SIGKILL:  # the worker failed on its own: show why, count it
            tally["worker failures"] += 1
        elif n < kills:
            tally["kills"] += 1
            killed_in[phase] += 1
    return {**tally, "killed in": dict(sorted(killed_in.items())), "committed": committed,
            "seconds": round(time.monotonic() - started)}  # fmt: skip


def delta_chunks(store: Path) -> int:
    """How many chunks of the checkpoints left at the end are deltas (codec "auto" at work)."""
    from ckptflow.catalog import checkpoints as catalog
    from ckptflow.store import open_store

    opened = open_store(str(store))
    return sum(len(catalog.read_manifest(opened, RUN, i.step).bases) for i in catalog.list_checkpoints(opened, RUN))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep the store here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptflow-soak-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = soak(args.kills, workdir, args.seed)
        result["delta chunks committed"] = delta_chunks(workdir / "store")
    print(json.dumps(result, indent=2))
    print(f"\n{result['kills']} SIGKILLs ({', '.join(f'{k}: {v}' for k, v in result['killed in'].items())}); "
          f"{result['restores checked']} restores checked: {result['wrong']} wrong, {result['stale']} stale; "
          f"{result.get('worker failures', 0)} worker failures; newest committed step {result['committed']}; "
          f"{result['delta chunks committed']} delta chunks in the surviving checkpoints; "
          f"{result['seconds']} s")  # fmt: skip
    return 0 if result["wrong"] == 0 and result["stale"] == 0 and not result.get("worker failures") else 1


if __name__ == "__main__":
    sys.exit(main())
