"""`make demo`: train a tiny language model with ckptflow checkpoints, crash, recover.

Shows the library end to end on CPU in well under a minute: full and async
incremental saves, a simulated crash and restore (weights, optimizer, scheduler, RNG,
data position), a checkpoint corrupted on purpose that restore skips and verify
reports, and the store's dedup figures. Then it drives the Dagster lifecycle over the store
in-process (pipelines/demo/lifecycle.py), starts the real dagster-daemon and watches it carry
another training process's checkpoints through (pipelines/demo/daemon.py), and prints the
summary; `make ui` shows the same.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time

import torch

from ckptflow import Checkpointer, SaveHandle, SavePolicy, gc
from ckptflow.catalog.checkpoints import list_checkpoints
from ckptflow.reports import recoveries
from ckptflow.reports.advice import advise
from ckptflow.reports.units import human_bytes, human_duration, human_steps
from pipelines.demo.damage import corrupt_newest
from pipelines.demo.model import build, train_step
from pipelines.demo.recover import recover_demo
from pipelines.demo.text import wrapped

DEMO_STORE = ".demo/store"
DEMO_ARCHIVE = ".demo/archive"
DEMO_DAGSTER_HOME = ".dagster_home"


def train(ck: Checkpointer, state: dict, start: int, stop: int, crash_at: int | None = None) -> int:
    for step in range(start + 1, stop + 1):
        loss = train_step(state)
        handle = ck.save(step, state, metadata={"train_loss": round(loss, 4)}, blocking=False)
        if handle is not None:
            assert isinstance(handle, SaveHandle)  # not blocking
            print(
                f"  step {step:4d}  loss {loss:.3f}  {handle.kind:<11} save, training held {handle.blocked_s * 1000:.1f} ms"
            )
        if step == crash_at:
            ck.wait()
            print(f"  step {step:4d}  *** simulated crash: process state lost ***")
            return step
    ck.wait()
    return stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store",
        default=os.environ.get("CKPTFLOW_STORE", DEMO_STORE),
        help="store URL; the default demo store is wiped first, any other keeps its chunks",
    )
    parser.add_argument("--run", default="tinylm-demo")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--crash-at", type=int, default=75)
    parser.add_argument(
        "--archive",
        default=os.environ.get("CKPTFLOW_ARCHIVE"),
        help=f"archive tier URL (default {DEMO_ARCHIVE} for the demo store, else <store>-archive)",
    )
    parser.add_argument(
        "--dagster-home",
        help=f"Dagster instance directory for the lifecycle (default {DEMO_DAGSTER_HOME}, "
        "what `make ui` reads, for the demo store, else <store>-dagster_home); the default one is reset first",
    )
    parser.add_argument("--no-lifecycle", action="store_true", help="skip the Dagster lifecycle part")
    parser.add_argument(
        "--no-daemon",
        action="store_true",
        help="skip the last part: the real dagster-daemon carrying another training script's checkpoints through",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="  [%(name)s] %(message)s")
    if args.store == DEMO_STORE:
        shutil.rmtree(args.store, ignore_errors=True)
    else:  # another store: only this run's checkpoints and recovery records
        for prefix in ("runs", "recoveries"):
            shutil.rmtree(os.path.join(args.store, prefix, args.run), ignore_errors=True)
    torch.manual_seed(0)
    policy = SavePolicy(full_every=40, incremental_every=10)

    print(f"== training run {args.run!r} into {args.store} (full every 40 steps, incremental every 10)")
    t0 = time.perf_counter()
    with Checkpointer(args.store, args.run, policy=policy) as ck:
        state = build()
        crashed_at = train(ck, state, 0, args.steps, crash_at=args.crash_at)

    print("== restart after the crash: a fresh process restores the newest valid checkpoint")
    with Checkpointer(args.store, args.run, policy=policy) as ck:
        state = build()
        result = ck.restore(state)
        print(
            f"  restored step {result.step} (data position {state['data'].position}, lr {state['sched'].get_last_lr()[0]:.2e}); "
            f"{crashed_at - result.step} steps to redo"
        )
        train(ck, state, result.step, args.steps)

        newest = ck.list()[-1]
        corrupt_newest(args.store, args.run)  # flip one byte of a chunk only the newest checkpoint uses
        print(f"== corrupted one chunk of step {newest.step} on purpose")
        report = ck.verify(newest.step)
        verdict = "ok" if report.ok else "CORRUPT" if report.damaged else "UNREADABLE"
        print(f"  verify step {newest.step}: {verdict}")
        for problem in report.problems:
            print(wrapped(problem, indent="    "))
        result = ck.restore(build())
        print(f"  restore picked step {result.step}; skipped:")
        for step, why in result.skipped:
            print(wrapped(f"step {step}: {why}", indent="    "))

    recover_demo(args.store.rstrip("/") + "-recover")

    infos = list_checkpoints(ck.store, args.run)
    logical = sum(i.logical_bytes for i in infos)
    written = sum(i.bytes_written for i in infos)
    print(
        f"== {len(infos)} checkpoints, {human_bytes(logical)} logical, {human_bytes(written)} written "
        f"(incremental + dedup saved {100 * (1 - written / logical):.0f}%)"
    )
    print(f"  {'step':>5} {'kind':<11} {'train_loss':>10} {'written MiB':>11}")
    for i in infos:
        print(
            f"  {i.step:>5} {i.kind:<11} {i.metadata.get('train_loss', float('nan')):>10.3f} {i.bytes_written / 2**20:>11.2f}"
        )
    gc_report = gc(args.store, grace="1h", dry_run=True)
    print(f"== gc dry run: {len(gc_report.deleted)} objects ({gc_report.bytes} bytes) unreferenced and past grace")
    ops = recoveries.run_metrics(ck.store, args.run)
    print(
        f"== recoveries: {ops.recoveries} ({ops.recoveries_ok} succeeded, {ops.fallbacks} fell back past a bad "
        f"checkpoint), median restore {ops.restore_s:.3f} s; a checkpoint every {ops.save_interval_s:.2f} s"
    )
    advice = advise(ck.store, args.run, scenario="preemptible")
    best = advice.recommended
    if advice.keep_current:
        about_current = " (the demo's own interval: none found costs less)"
    elif advice.current is not None:
        steps = human_steps(advice.current.interval_steps, unknown="?")
        about_current = f"; the demo's every {steps} steps loses {100 * advice.current.waste:.2f}%"
    else:
        about_current = ""
    print(
        f"== checkpoint interval (ckptflow advise {args.store} --run {args.run} --scenario preemptible): every "
        f"{human_steps(best.interval_steps, unknown='?')} steps ({human_duration(best.interval_s)}), "
        f"{100 * best.waste:.2f}% of the time lost to saves, failures and restores{about_current}"
    )
    status = 0
    if not args.no_lifecycle:
        from pipelines.demo.lifecycle import run_lifecycle  # Dagster only when asked for

        default = args.store == DEMO_STORE
        archive = args.archive or (DEMO_ARCHIVE if default else args.store.rstrip("/") + "-archive")
        home = args.dagster_home or (DEMO_DAGSTER_HOME if default else args.store.rstrip("/") + "-dagster_home")
        fresh = default and not args.archive and not args.dagster_home
        status = run_lifecycle(
            os.path.abspath(args.store),
            os.path.abspath(archive),
            os.path.abspath(home),
            fresh=fresh,
            daemon=not args.no_daemon,
        )
    print(
        f"== demo finished in {time.perf_counter() - t0:.1f} s; try: .venv/bin/ckptflow ls {args.store} "
        f"and .venv/bin/ckptflow verify {args.store} --run {args.run} --all"
    )
    return status
