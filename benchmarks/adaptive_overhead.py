"""Checkpoint overhead of a real training loop under three policies, in one run each.

An MLP with AdamW trains ``--steps`` steps per policy; saves are async (the loop is held for
the copy to host memory, plus any wait for the previous save). Reported per policy: saves,
the time the loop was held (from each manifest's ``save_cost``), that as a share of wall time,
and the expected loss per failure (``ckptflow.policy.interval``) at the mean interval, for an
MTBF of ``--mtbf`` seconds. The policies: a save every step, every 1000 steps, and
``SavePolicy.adaptive(max_overhead=0.02)``. The target: adaptive at most 2% of wall time.

    python benchmarks/adaptive_overhead.py [--steps 600] [--mtbf 3600]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time

import torch
from torch import nn

from ckptflow import Checkpointer, SavePolicy, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.policy.interval import IntervalInputs, evaluate


def run(policy, steps: int, root: str) -> tuple[int, float, float, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    optim = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": optim}
    started = time.perf_counter()
    with Checkpointer(root, "bench", policy=policy) as ckpt:
        for step in range(steps):
            model(torch.randn(256, 512)).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
            ckpt.save(step, state, blocking=False)
        ckpt.wait()
    wall = time.perf_counter() - started
    costs = [m.save_cost for m in catalog.committed(open_store(root), "bench") if m.save_cost]
    held = sum(c.blocked_s for c in costs)
    steps_known = [c.step_time_s for c in costs if c.step_time_s]
    step_s = sorted(steps_known)[len(steps_known) // 2] if steps_known else wall / steps
    return len(costs), held, wall, step_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--mtbf", type=float, default=3600.0)
    args = parser.parse_args()
    policies = {
        "every step": SavePolicy(full_every=10, incremental_every=1),
        "every 1000 steps": SavePolicy(full_every=1000),
        "adaptive (2%)": SavePolicy.adaptive(max_overhead=0.02, mtbf_s=args.mtbf, initial_every=50),
    }
    print(f"{'POLICY':<18}{'SAVES':>6}{'HELD S':>9}{'WALL S':>9}{'OVERHEAD':>10}{'LOSS/FAILURE':>14}")
    adaptive = 1.0
    for name, policy in policies.items():
        root = tempfile.mkdtemp(prefix="ckptflow-adaptive-")
        try:
            saves, held, wall, step_s = run(policy, args.steps, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        interval = args.steps / saves * step_s if saves else args.steps * step_s
        mean_save = held / saves if saves else 0.0
        inputs = IntervalInputs(save_s=mean_save, save_duration_s=mean_save, restore_s=0.0, mtbf_s=args.mtbf)
        loss = evaluate(inputs, interval).loss_per_failure_s
        print(f"{name:<18}{saves:>6}{held:>9.2f}{wall:>9.2f}{100 * held / wall:>9.2f}%{loss:>13.1f}s")
        if name.startswith("adaptive"):
            adaptive = held / wall
    verdict = "within" if adaptive <= 0.02 else "NOT within"
    print(f"\nadaptive overhead {100 * adaptive:.2f}% of wall time: {verdict} 2%")
    return 0 if adaptive <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
