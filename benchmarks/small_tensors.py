#!/usr/bin/env python
"""Saves of a state with many small tensors: ckptflow with and without packs, against peers.

Fine-tunes all-MiniLM-L6-v2 (BertModel + a 2-way head, every layer trained, AdamW) on the
generated task of ``_motion`` and, after every training step, saves the whole state
(weights, both AdamW moments, AdamW's step counters: ~420 tensors, ~300 of them under
256 KiB) with each method:

  ckptflow incremental   one Checkpointer per mode for the whole run: a full first, then
                         incremental saves (what changed since the previous save is written)
  ckptflow full          a full save every step into one store
  torch.save, safetensors, DCP   the state written anew (fsynced) every step

Modes: packs (``pack_bytes`` 1 MiB, the default: ``ckptflow.dcp.packs``) and none
(``pack_bytes=0``: each tensor its own chunk object). Each round restores the step just
saved into a zeroed copy of the state (page cache warm) and checks it bit for bit.
``--copies K`` adds K trained copies of the encoder: K+1 times the small tensors.
``--bitfit`` trains only the biases, the LayerNorms and the head (BitFit: Ben Zaken et al.,
2022), so what an incremental save writes is small tensors only, as in a LoRA fine-tune.

Columns: median save and restore seconds, their ratios to torch.save / torch.load +
copy, and the chunk objects (files) a ckptflow save wrote.

Run: ``.venv/bin/python benchmarks/small_tensors.py --steps 12``
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
import torch.distributed.checkpoint as dcp  # noqa: E402
from _motion import Task, build, model_files, scratch, train_step  # noqa: E402
from _util import check_equal, clear, copy_into, fresh, fsync_file, quiet  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402

from ckptflow import Checkpointer  # noqa: E402
from ckptflow.catalog import checkpoints as catalog  # noqa: E402

PACKS = {"packs": 1 << 20, "no packs": 0}


def flat_state(net: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the training state by name: what each method saves (the same bytes)."""
    state = {f"model.{k}": v for k, v in net.state_dict().items()}
    for index, per_param in optim.state_dict()["state"].items():
        state |= {f"optim.{index}.{k}": v for k, v in per_param.items() if isinstance(v, torch.Tensor)}
    return state


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Methods:
    def __init__(self, work: Path):
        self.work = work
        self.incremental = {m: Checkpointer(work / f"inc-{m}", "small", pack_bytes=b) for m, b in PACKS.items()}
        self.full = {m: Checkpointer(work / f"full-{m}", "small", pack_bytes=b) for m, b in PACKS.items()}

    def close(self) -> None:
        for ck in [*self.incremental.values(), *self.full.values()]:
            ck.close()

    def round(self, step: int, state: dict, target: dict) -> dict[str, tuple[float, float, int | None]]:
        """(save s, restore s, chunk objects written) per method."""
        out = {}
        for mode in PACKS:
            for kind, ck in (("incremental", self.incremental[mode]), ("full", self.full[mode])):
                if kind == "incremental" and step == 1:
                    ck.save(step, {"s": state}, kind="full", rng=False)  # the base: not measured
                    continue
                save = timed(lambda ck=ck, kind=kind: ck.save(step, {"s": state}, kind=kind, rng=False))
                written = catalog.read_manifest(ck.store, "small", step).stats.chunks_written
                clear(target)
                restore = timed(lambda ck=ck: ck.restore({"s": target}, step=step))
                check_equal(state, target, f"ckptflow {kind} ({mode})")
                out[f"ckptflow {kind} ({mode})"] = (save, restore, written)
        path = fresh(self.work / "torch") / "state.pt"
        save = timed(lambda: (torch.save(state, path), fsync_file(path)))
        clear(target)
        out["torch.save"] = (save, timed(lambda: copy_into(target, torch.load(path, weights_only=True))), None)
        check_equal(state, target, "torch.save")
        path = fresh(self.work / "safetensors") / "state.safetensors"
        save = timed(lambda: (save_file(state, str(path)), fsync_file(path)))
        clear(target)
        out["safetensors"] = (save, timed(lambda: copy_into(target, load_file(str(path)))), None)
        check_equal(state, target, "safetensors")
        path = fresh(self.work / "dcp")
        with quiet():
            save = timed(lambda: dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True))
            clear(target)
            out["DCP"] = (
                save,
                timed(lambda: dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)),
                None,
            )
        check_equal(state, target, "DCP")
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="training steps, each followed by every method's save")
    ap.add_argument("--copies", type=int, default=0, help="trained copies of the encoder added to the model")
    ap.add_argument("--bitfit", action="store_true", help="train only biases, LayerNorms and the head")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: .bench/ in the repo)")
    args = ap.parse_args(argv)
    work = scratch(args.dir, "small_tensors")
    if work is None:
        return 0
    config, weights = model_files()
    net = build(config, weights)
    for i in range(args.copies):
        net[f"copy_{i}"] = copy.deepcopy(net["bert"])
    if args.bitfit:
        for name, p in net.named_parameters():
            p.requires_grad_(name.startswith("head.") or name.endswith(".bias") or "LayerNorm" in name)
    optim = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)
    task = Task(vocab=json.loads(Path(config).read_text())["vocab_size"], batch=args.batch)
    train_step(net, optim, task)  # AdamW's state exists from here
    state = flat_state(net, optim)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    methods = Methods(work)
    rows: dict[str, list[tuple[float, float, int | None]]] = {}
    load = os.getloadavg()[0]
    try:
        for step in range(1, args.steps + 1):
            train_step(net, optim, task)  # in place: ``state`` holds the same tensors
            for method, result in methods.round(step, state, target).items():
                rows.setdefault(method, []).append(result)
            load = max(load, os.getloadavg()[0])
    finally:
        methods.close()
        shutil.rmtree(work, ignore_errors=True)
    small = [v for v in state.values() if v.numel() * v.element_size() <= 256 << 10]
    print(
        f"all-MiniLM-L6-v2 + {args.copies} encoder copies, {'BitFit' if args.bitfit else 'every layer trained'}, "
        f"AdamW: {len(state)} tensors, "
        f"{sum(v.nbytes for v in state.values()) / 2**20:.1f} MiB, {len(small)} of them under 256 KiB "
        f"({sum(v.nbytes for v in small) / 2**20:.1f} MiB); {args.steps} steps, medians; "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print()
    print("| method | save s | vs torch.save | restore s | vs torch.load | objects written |")
    print("|---|--:|--:|--:|--:|--:|")
    med = {m: [statistics.median(x) if x[0] is not None else None for x in zip(*r)] for m, r in rows.items()}
    base_save, base_restore = med["torch.save"][0], med["torch.save"][1]
    for method, (save, restore, written) in med.items():
        files = "-" if written is None else f"{written:.0f}"
        print(
            f"| {method} | {save:.4f} | {save / base_save:.2f}x | {restore:.4f} | {restore / base_restore:.2f}x "
            f"| {files} |"
        )
    for kind in ("incremental", "full"):
        packed, alone = med[f"ckptflow {kind} (packs)"][0], med[f"ckptflow {kind} (no packs)"][0]
        print(f"\n{kind} save with packs: {packed / alone:.2f}x the time without", end="")
    print()
    if load > 0.75 * (os.cpu_count() or 1):
        print(f"WARNING: the machine was busy (load average up to {load:.1f}); times are noisy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
