#!/usr/bin/env python
"""Incremental saves of a fine-tune whose backbone is frozen: with and without write tracking.

Fine-tunes all-MiniLM-L6-v2 (BertModel + a 2-way head, AdamW) with every layer frozen but
the top ``--trained-layers`` and the head, and saves model + optimizer after every step,
incremental (a full first). It runs in blocks of ``--block`` steps, alternating two
Checkpointers on two stores: one that skips reading what the kernel saw no write to
(``track_writes=True``, the default: ``ckptflow.dcp.written_pages``) and one that reads
every byte (``track_writes=False``). The first save of each block (a full) is left out.
``--frozen-copies K`` adds K frozen copies of the pretrained encoder to the saved state (real
weights, never trained): the size of a larger frozen backbone, as in a LoRA fine-tune of a
model a few GiB large.

Columns: median incremental save wall time and CPU time, the share of the state's bytes the
save read, and the median training step time (forward, backward, AdamW): write tracking
costs the loop a fault on the first write to each protected page after a save.

Run: ``.venv/bin/python benchmarks/frozen_backbone.py --steps 60``
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from _motion import Task, build, model_files, scratch, train_step  # noqa: E402

from ckptflow import Checkpointer  # noqa: E402

MODES = {"write tracking (default)": True, "every byte read (track_writes=False)": False}


def frozen_model(trained_layers: int, frozen_copies: int = 0):
    config, weights = model_files()
    net = build(config, weights)
    for i in range(frozen_copies):
        net[f"frozen_{i}"] = copy.deepcopy(net["bert"])
    layers = net["bert"].encoder.layer
    for p in net.parameters():
        p.requires_grad_(False)
    for module in [*layers[len(layers) - trained_layers :], net["head"]]:
        for p in module.parameters():
            p.requires_grad_(True)
    optim = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)
    return net, optim, config


def run(args: argparse.Namespace, work: Path) -> dict[str, dict[str, list[float]]]:
    net, optim, config = frozen_model(args.trained_layers, args.frozen_copies)
    task = Task(vocab=json.loads(Path(config).read_text())["vocab_size"], batch=args.batch)
    results: dict[str, dict[str, list[float]]] = {
        mode: {"save": [], "cpu": [], "read": [], "step": []} for mode in MODES
    }
    step = 0
    blocks = max(1, args.steps // args.block)
    for block in range(blocks):
        for mode, tracking in MODES.items():
            root = work / f"{block}-{tracking}"
            with Checkpointer(root, "frozen", track_writes=tracking) as ck:
                for i in range(args.block):
                    step += 1
                    started = time.perf_counter()
                    train_step(net, optim, task)
                    trained = time.perf_counter() - started
                    state = {"model": net, "optim": optim}
                    started, cpu = time.perf_counter(), time.process_time()
                    info = ck.save(step, state, kind="full" if i == 0 else "incremental").info
                    if i == 0:
                        continue
                    row = results[mode]
                    row["save"].append(time.perf_counter() - started)
                    row["cpu"].append(time.process_time() - cpu)
                    row["read"].append(1 - info.bytes_unread / info.logical_bytes)
                    if i > 1:  # the step after the full: every page was protected by the full save
                        row["step"].append(trained)
            shutil.rmtree(root, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="training steps in all (each followed by a save)")
    ap.add_argument("--block", type=int, default=10, help="steps per block; blocks alternate the two modes")
    ap.add_argument("--trained-layers", type=int, default=1, help="top encoder layers trained (of 6)")
    ap.add_argument("--frozen-copies", type=int, default=0, help="frozen copies of the encoder added to the state")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: .bench/ in the repo)")
    args = ap.parse_args(argv)
    work = scratch(args.dir, "frozen_backbone")
    if work is None:
        return 0
    load = os.getloadavg()[0]
    try:
        results = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    net, optim, _config = frozen_model(args.trained_layers, args.frozen_copies)
    trained = sum(p.numel() for p in net.parameters() if p.requires_grad)
    total = sum(p.numel() for p in net.parameters())
    print(
        f"all-MiniLM-L6-v2 with {args.frozen_copies} frozen copies of its encoder "
        f"({total * 4 / 2**20:.1f} MiB fp32), top {args.trained_layers} layer(s) + head trained "
        f"({trained * 4 / 2**20:.1f} MiB, AdamW moments for those only), {args.steps} steps in blocks of "
        f"{args.block}, an incremental save after every step; {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print()
    print("| saves | incremental save s | save cpu s | bytes read | training step s |")
    print("|---|--:|--:|--:|--:|")
    med = {mode: {k: statistics.median(v) for k, v in row.items() if v} for mode, row in results.items()}
    for mode, row in med.items():
        print(f"| {mode} | {row['save']:.4f} | {row['cpu']:.4f} | {row['read']:.1%} | {row['step']:.4f} |")
    tracked, hashed = (med[m] for m in MODES)
    print(
        f"\nwith write tracking: saves {tracked['save'] / hashed['save']:.2f}x the time, "
        f"training steps {tracked['step'] / hashed['step']:.2f}x"
    )
    load = max(load, os.getloadavg()[0])
    if load > 0.75 * (os.cpu_count() or 1):
        print(f"WARNING: the machine was busy (load average up to {load:.1f}); times are noisy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
