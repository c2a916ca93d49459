#!/usr/bin/env python
"""Codecs on real weights in motion: stored bytes, save, restore and decode speed.

Fine-tunes all-MiniLM-L6-v2 (BertModel + a 2-way head, AdamW) on a generated task and
saves model + optimizer after every step with each codec (``raw``, ``zstd``, ``auto``)
into its own store, full every ``--full-every`` steps and incremental in between.
Every codec saves the same state at the same step (in rotating order). Also saved:
the model's weights cast to bf16 (``auto``), and at the end a lossy archive copy
(bf16 weights + 8-bit moments) of the last full checkpoint, re-evaluated.

Columns: stored bytes a save wrote as a ratio of the state's raw bytes (full saves;
incremental saves one step after a full; all incremental saves), median save wall
time, restore wall time (the last full; the incremental after it), and decode speed:
raw bytes per CPU second of decoding that checkpoint's chunks on one thread (a delta's
base decoded too; hashing not included).

Run: ``.venv/bin/python benchmarks/codecs_motion.py --steps 100``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from _motion import REAL_PACKAGE, Task, build, evaluator, model_files, scratch, train_step  # noqa: E402

from ckptflow import Checkpointer, SavePolicy, gc, lifecycle  # noqa: E402
from ckptflow.catalog import checkpoints as catalog  # noqa: E402
from ckptflow.chunks import codecs  # noqa: E402
from ckptflow.chunks.lossy import ArchiveCodec  # noqa: E402
from ckptflow.format.layout import chunk_key  # noqa: E402
from ckptflow.format.manifest import Manifest  # noqa: E402
from ckptflow.store import Store, open_store  # noqa: E402

CODECS = ("raw", "zstd", "auto")
BF16 = "auto, bf16 weights"
RUN = "minilm"


@dataclass
class Save:
    codec: str
    step: int
    kind: str
    after_full: int  # steps since the newest full (0 for a full)
    logical: int
    stored: int
    seconds: float


@dataclass
class Restore:
    codec: str
    step: int
    seconds: float
    decode_gbps: float


def decode_rate(store: Store, manifest: Manifest) -> float:
    """Raw GB per CPU second decoding every chunk the tensors need, on this thread."""
    wanted = {d for item in manifest.items() for d, _ in item.chunks}
    blobs = {d: store.get(chunk_key(d)) for d in wanted | set(manifest.bases.values())}
    raw = 0
    started = time.process_time()
    for digest in wanted:
        raw += len(codecs.decode(blobs[digest], lambda base, _n: blobs[base], expected=manifest.chunks[digest]))
    return raw / max(1e-9, time.process_time() - started) / 1e9


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path):
        files = model_files()
        assert files is not None
        self.files, self.args, self.work = files, args, work
        self.net = build(*files)
        self.optim = torch.optim.AdamW(self.net.parameters(), lr=args.lr, weight_decay=0.01)
        self.task = Task(
            self.net["bert"].config.vocab_size, batch=args.batch, length=args.length, uniform=args.tokens == "uniform"
        )
        policy = SavePolicy(full_every=args.full_every, incremental_every=1)
        self.stores = {c: open_store(str(work / c.replace(", ", "-").replace(" ", "-"))) for c in (*CODECS, BF16)}
        self.cks = {
            c: Checkpointer(self.stores[c], RUN, codec="auto" if c == BF16 else c, policy=policy, threads=args.threads)
            for c in (*CODECS, BF16)
        }
        self.saves: list[Save] = []
        self.restores: list[Restore] = []
        self.measured_full: int | None = None  # the full checkpoint whose restore is measured
        self.last_full = 0

    def state(self) -> dict:
        return {"model": self.net, "optim": self.optim}

    def bf16_state(self) -> dict:
        return {
            "model": {
                k: v.detach().to(torch.bfloat16) for k, v in self.net.state_dict().items() if v.is_floating_point()
            }
        }

    def run(self) -> None:
        last_full = 0
        for step in range(1, self.args.steps + 1):
            loss = train_step(self.net, self.optim, self.task)
            kind = "full" if step == 1 or step % self.args.full_every == 0 else "incremental"
            if kind == "full":
                if last_full and step + self.args.full_every > self.args.steps:  # the last full cycle ends
                    self.measured_full = last_full
                    self._restores(last_full)
                    self._restores(last_full + 1)
                self._prune()
                last_full = step
            order = CODECS[step % 3 :] + CODECS[: step % 3]
            for codec in (*order, BF16):
                state = self.bf16_state() if codec == BF16 else self.state()
                started = time.perf_counter()
                self.cks[codec].save(step, state, metadata={"train_loss": loss}, kind=kind)
                seconds = time.perf_counter() - started
                m = catalog.read_manifest(self.stores[codec], RUN, step)
                self.saves.append(
                    Save(codec, step, kind, step - last_full, m.stats.logical_bytes, m.stats.stored_written, seconds)
                )
            if step % 10 == 0:
                print(f"  step {step}: loss {loss:.3f}, embedding rows touched {self.task.coverage:.1%}", flush=True)
        self.last_full = last_full
        if self.measured_full is None:  # no full cycle ended before the last step
            self.measured_full = last_full
            self._restores(last_full)
            if last_full + 1 <= self.args.steps:
                self._restores(last_full + 1)
        if self.args.steps > last_full + 1:
            self._restores(self.args.steps)

    def _restores(self, step: int) -> None:
        scratch_net = build(*self.files, seed=1)
        scratch_opt = torch.optim.AdamW(scratch_net.parameters(), lr=self.args.lr)
        train_step(scratch_net, scratch_opt, Task(self.task.vocab, batch=2, length=8, seed=99))  # moments exist
        for codec in CODECS:
            target = {"model": scratch_net, "optim": scratch_opt}
            started = time.perf_counter()
            self.cks[codec].restore(target, step=step)
            seconds = time.perf_counter() - started
            manifest = catalog.read_manifest(self.stores[codec], RUN, step)
            self.restores.append(Restore(codec, step, seconds, decode_rate(self.stores[codec], manifest)))
        if step == self.args.steps and self.args.steps > self.last_full + 1:  # the newest holds the live weights
            live = self.net.state_dict()
            assert all(torch.equal(v, live[k]) for k, v in scratch_net.state_dict().items())

    def _prune(self) -> None:
        """Disk stays bounded: before a full save, expire every checkpoint but the
        restore targets, then GC (the new full is the next base)."""
        for codec, store in self.stores.items():
            for info in self.cks[codec].list():
                lifecycle.expire(store, RUN, info.step)
            gc(store, grace=0)

    def lossy(self) -> dict:
        """A bf16+int8 archive copy of the last full (auto store), re-evaluated."""
        src = self.stores["auto"]
        archive = open_store(str(self.work / "archive"))
        score = evaluator(*self.files, self.task.heldout())
        report = lifecycle.archive(
            src, archive, RUN, self.last_full, codec=ArchiveCodec.parse("bf16+int8"), evaluator=score
        )
        assert report.ok, report.problems
        copy = catalog.read_manifest(archive, RUN, self.last_full)
        exact = catalog.read_manifest(src, RUN, self.last_full)
        return {
            "ratio_of_raw": copy.stats.stored_bytes / exact.stats.logical_bytes,
            "ratio_of_exact_stored": copy.stats.stored_bytes / exact.stats.stored_bytes,
            **(report.evaluation or {}),
        }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(saves: list[Save], restores: list[Restore], last_full: int) -> dict[str, dict]:
    out = {}
    for codec in (*CODECS, BF16):
        mine = [s for s in saves if s.codec == codec]
        full = [s for s in mine if s.kind == "full"]
        incr = [s for s in mine if s.kind == "incremental"]
        first = [s for s in incr if s.after_full == 1]
        back = [r for r in restores if r.codec == codec]
        out[codec] = {
            "full": median([s.stored / s.logical for s in full]),
            "incr_1": median([s.stored / s.logical for s in first]),
            "incr_all": median([s.stored / s.logical for s in incr]),
            "save_full_s": median([s.seconds for s in full]),
            "save_incr_s": median([s.seconds for s in incr]),
            "restore_full_s": next((r.seconds for r in back if r.step == last_full), None),
            "restore_incr_s": next((r.seconds for r in back if r.step == last_full + 1), None),
            "decode_full": next((r.decode_gbps for r in back if r.step == last_full), None),
            "decode_incr": next((r.decode_gbps for r in back if r.step == last_full + 1), None),
        }
    return out


def fmt(x: float | None, pattern: str = "{:.3f}") -> str:
    return "-" if x is None else pattern.format(x)


def table(rows: dict[str, dict], lossy: dict) -> str:
    raw = rows["raw"]
    head = [
        "codec", "full / raw", "incr +1 / raw", "incr all / raw", "save full s", "x raw",
        "save incr s", "x raw", "restore full s", "restore incr s", "decode GB/s/core (full, incr)",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|"]
    for codec, r in rows.items():
        cells = [
            codec, fmt(r["full"]), fmt(r["incr_1"]), fmt(r["incr_all"]),
            fmt(r["save_full_s"]), fmt(r["save_full_s"] / raw["save_full_s"], "{:.2f}x"),
            fmt(r["save_incr_s"]), fmt(r["save_incr_s"] / raw["save_incr_s"], "{:.2f}x"),
            fmt(r["restore_full_s"]), fmt(r["restore_incr_s"]),
            "nothing to decode" if codec == "raw" else f"{fmt(r['decode_full'], '{:.2f}')}, "
            + fmt(r["decode_incr"], "{:.2f}"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        f"| lossy archive (bf16 + 8-bit moments) of the last full | {lossy['ratio_of_raw']:.3f} | | | | | | | | | |"
    )
    return "\n".join(lines)


def targets(rows: dict[str, dict], lossy: dict) -> list[tuple[bool, str]]:
    auto, raw, bf16 = rows["auto"], rows["raw"], rows[BF16]
    change = lossy.get("metric_change", {})
    checks = [
        (auto["full"] <= 0.75, f"auto full <= 0.75x raw (fp32 weights + AdamW): {auto['full']:.3f}"),
        (auto["incr_1"] <= 0.60, f"auto incremental 1 step after a full <= 0.60x: {auto['incr_1']:.3f}"),
        (bf16["full"] <= 0.67, f"bf16 weights (auto, full) <= 0.67x: {bf16['full']:.3f}"),
        (
            lossy["ratio_of_raw"] <= 0.30,
            f"lossy archive <= 0.30x of the exact fp32 checkpoint: {lossy['ratio_of_raw']:.3f} "
            f"(metric change: {', '.join(f'{k} {v:+.4f}' for k, v in change.items()) or 'not evaluated'})",
        ),
    ]
    for kind in ("full", "incr"):
        ratio = auto[f"save_{kind}_s"] / raw[f"save_{kind}_s"]
        checks.append((ratio <= 2.0, f"auto save time ({kind}) <= 2.0x raw: {ratio:.2f}x"))
    rates = [r for r in (auto["decode_full"], auto["decode_incr"]) if r is not None]
    slowest = min(rates) if rates else 0.0
    checks.append((slowest >= 1.0, f"restore decodes >= 1 GB/s per core (auto, slower of full/incr): {slowest:.2f}"))
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--full-every", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument(
        "--tokens",
        choices=["zipf", "uniform"],
        default="zipf",
        help="token ids of the generated task: Zipf like text (a fine-tuning set touches part of the "
        "embedding) or uniform (every row moves: the dense case)",
    )
    ap.add_argument("--threads", type=int, default=None, help="ckptflow I/O threads (default: the library's)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: .bench/ in the repo)")
    ap.add_argument("--json", metavar="PATH", default=None)
    args = ap.parse_args(argv)
    work = scratch(args.dir, "codecs_motion")
    if work is None:
        return 0
    load = os.getloadavg()[0]
    bench = Bench(args, work)
    nbytes = sum(t.numel() * t.element_size() for t in bench.net.state_dict().values())
    print(
        f"all-MiniLM-L6-v2 from {REAL_PACKAGE} ({nbytes / 2**20:.1f} MiB of fp32 weights, AdamW doubles it) fine-tuned "
        f"{args.steps} steps, lr {args.lr:g}, batch {args.batch}x{args.length} {args.tokens} tokens; "
        f"full every {args.full_every}, "
        f"incremental every step; {os.cpu_count()} CPUs, torch {torch.__version__}; scratch {work}"
    )
    try:
        bench.run()
        lossy = bench.lossy()
    finally:
        for ck in bench.cks.values():
            ck.close()
        shutil.rmtree(work, ignore_errors=True)
    rows = summary(bench.saves, bench.restores, bench.measured_full or bench.last_full)
    print()
    print(table(rows, lossy))
    print(f"\nembedding rows the training batches touched: {bench.task.coverage:.1%}")
    load = max(load, os.getloadavg()[0])
    if load > 0.75 * (os.cpu_count() or 1):
        print(f"WARNING: the machine was busy (load average up to {load:.1f}); times are inflated and noisy")
    print()
    for ok, line in targets(rows, lossy):
        print(f"{'PASS' if ok else 'FAIL'}  {line}")
    if args.json:
        doc = {"rows": rows, "lossy": lossy, "saves": [asdict(s) for s in bench.saves]}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
