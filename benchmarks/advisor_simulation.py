"""The checkpoint-interval model against a simulation of exponential failures.

For each save cost C (1 s to 10 min), MTBF (1 h to 1 week) and restore time R (0 to 10
min), the expected fraction of wall time lost at Daly's optimal interval
(``ckptflow.policy.interval.waste``) next to the fraction a discrete-event simulation of
``--failures`` failures measures (``ckptflow.policy.interval_sim``), and their relative
difference; also Young's first-order interval sqrt(2CM) next to Daly's. The target: every
row within 5%. Seeded: the same seed prints the same table.

    python benchmarks/advisor_simulation.py [--failures 40000] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time

from ckptflow.policy.interval import daly, waste, young
from ckptflow.policy.interval_sim import simulate_waste
from ckptflow.reports.units import human_duration

SAVES = (1.0, 10.0, 60.0, 600.0)
MTBFS = (3600.0, 6 * 3600.0, 86400.0, 7 * 86400.0)
RESTORES = (0.0, 60.0, 600.0)
TARGET = 0.05


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--failures", type=int, default=40_000, help="simulated failures per row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    header = ["C", "MTBF", "R", "YOUNG", "DALY", "MODEL WASTE", "SIMULATED", "DIFF"]
    print("  ".join(f"{h:>11}" for h in header))
    worst = 0.0
    for c in SAVES:
        for m in MTBFS:
            for r in RESTORES:
                interval = daly(c, m)
                expected = waste(interval, save_s=c, mtbf_s=m, restore_s=r)
                simulated = simulate_waste(
                    interval, save_s=c, mtbf_s=m, restore_s=r, failures=args.failures, seed=args.seed
                )
                diff = (simulated - expected) / expected
                worst = max(worst, abs(diff))
                cells = [human_duration(x) for x in (c, m, r, young(c, m), interval)]
                cells += [f"{100 * expected:.3f}%", f"{100 * simulated:.3f}%", f"{100 * diff:+.2f}%"]
                print("  ".join(f"{x:>11}" for x in cells))
    verdict = "within" if worst <= TARGET else "NOT within"
    took = time.perf_counter() - started
    print(f"\nworst relative difference {100 * worst:.2f}%: {verdict} the {100 * TARGET:g}% target ({took:.1f} s)")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
