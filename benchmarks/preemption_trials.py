"""Preemption trials: SIGTERM at a random step, SIGKILL after a grace period, then restore.

Each trial starts the trainer of ``tests/support/preempted_trainer.py`` (weights a pure
function of the step, async saves every 7 steps, a ``PreemptionHandler``) on 1 rank, or on 2
gloo ranks every ``--two-rank-every`` trials, resuming the previous trial's store; sends
SIGTERM to one rank once it reports a random step; SIGKILLs whatever still runs after
``--grace`` seconds (as a scheduler does); then restores. Reported per trial: the step
signalled, the last step every rank finished, the step restored and the steps lost (last
finished minus restored). The target: 0 steps lost, every restore exact.

    python benchmarks/preemption_trials.py [--trials 20] [--grace 10]
"""

from __future__ import annotations

import argparse
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ckptflow import Checkpointer

TRAINER = Path(__file__).resolve().parents[1] / "tests" / "support" / "preempted_trainer.py"
RUN, N = "preempted", 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(root: str, world: int, rng: random.Random, grace: float) -> tuple[int, int, int]:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(TRAINER), root, str(r), str(world), port], stdout=subprocess.PIPE, text=True
        )
        for r in range(world)
    ]
    victim = procs[rng.randrange(world)]
    assert victim.stdout is not None
    first, signalled, wait_steps = None, None, rng.randrange(3, 60)
    for line in victim.stdout:
        words = line.split()
        if words[:1] == ["step"]:
            first = int(words[1]) if first is None else first
            if int(words[1]) >= first + wait_steps:
                signalled = int(words[1])
                victim.send_signal(signal.SIGTERM)
                break
    deadline = time.monotonic() + grace
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()  # the scheduler's SIGKILL after the grace period
            outs.append(p.communicate()[0])
    finished = [
        max((int(w[1]) for w in map(str.split, out.splitlines()) if w[:1] == ["step"]), default=-1) for out in outs
    ]
    finished[procs.index(victim)] = max(finished[procs.index(victim)], signalled or -1)
    state = {"w": torch.zeros(N, dtype=torch.float64), "step": -1}
    with Checkpointer(root, RUN) as ckpt:
        restored = ckpt.restore(state).step
    assert torch.equal(state["w"], torch.arange(N, dtype=torch.float64) + restored), "restore not exact"
    return signalled or -1, min(finished), restored


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--two-rank-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lost_total = 0
    print(f"{'TRIAL':>5}{'RANKS':>6}{'SIGNALLED':>10}{'FINISHED':>9}{'RESTORED':>9}{'LOST':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.trials):
            world = 2 if args.two_rank_every and i % args.two_rank_every == args.two_rank_every - 1 else 1
            root = str(Path(tmp) / f"store-{world}")  # each world size resumes its own run
            signalled, finished, restored = trial(root, world, rng, args.grace)
            lost = finished - restored
            lost_total += max(lost, 0)
            print(f"{i:>5}{world:>6}{signalled:>10}{finished:>9}{restored:>9}{lost:>6}")
    print(f"\n{args.trials} trials: {lost_total} steps lost, every restore exact")
    return 0 if lost_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
