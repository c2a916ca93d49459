#!/usr/bin/env python
"""`make scale`, second half: the Dagster side at many partitions.

Measured on a SQLite instance on disk (what ``dagster dev`` and the demo use):
- one tick of each automation sensor (``lifecycle_automation``, ``evaluation_automation``)
  with ``--partitions`` checkpoints registered, evaluated by Dagster's own evaluator
  (``evaluate_automation_conditions``, what the daemon runs) from the cursor of the
  previous tick; nothing is materialized, so the tick measures what every partition
  costs, not a backlog of work;
- dropping ``--expire`` partitions the way ``retention_job`` does (``pipelines/jobs.py``).

Run: ``.venv/bin/python benchmarks/partitions.py --partitions 40000 --expire 10000``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def measure(partitions: int, expire: int) -> list[tuple[str, float]]:
    from dagster import DagsterInstance, evaluate_automation_conditions

    from assets.partitions import checkpoint_key, checkpoints_partitions, drop_checkpoint_partitions
    from pipelines.definitions import build_definitions, evaluation_automation, lifecycle_automation

    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        defs = build_definitions("local", store=os.path.join(tmp, "store"), archive=os.path.join(tmp, "archive"))
        os.makedirs(os.path.join(tmp, "dagster"))
        with DagsterInstance.local_temp(tempdir=os.path.join(tmp, "dagster")) as instance:
            keys = [checkpoint_key("scale", step) for step in range(partitions)]
            started = time.perf_counter()
            for start in range(0, len(keys), 5000):
                instance.add_dynamic_partitions(checkpoints_partitions.name, keys[start : start + 5000])
            print(f"registered {partitions} partitions in {time.perf_counter() - started:.1f} s", flush=True)
            for sensor in (lifecycle_automation, evaluation_automation):
                selection = sensor.asset_selection
                cursor = evaluate_automation_conditions(defs, instance, asset_selection=selection).cursor
                started = time.perf_counter()
                evaluate_automation_conditions(defs, instance, asset_selection=selection, cursor=cursor)
                rows.append((f"{sensor.name} tick, {partitions} partitions", time.perf_counter() - started))
                print(f"  {rows[-1][0]}: {rows[-1][1]:.2f} s", flush=True)
            started = time.perf_counter()
            drop_checkpoint_partitions(instance, keys[:expire])
            rows.append((f"retention: drop {expire} partitions", time.perf_counter() - started))
            print(f"  {rows[-1][0]}: {rows[-1][1]:.2f} s", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=40_000)
    parser.add_argument("--expire", type=int, default=10_000)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = measure(args.partitions, args.expire)
    print("\n| operation | seconds |\n|---|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
