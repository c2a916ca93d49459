#!/usr/bin/env python
"""`make scale`: a store of 10,000 checkpoints on S3 behind 20 ms of latency per request.

A local S3 server (moto) holds the store; every request of the code under test goes
through an HTTP proxy on 127.0.0.1 that holds it for ``--latency-ms`` first, so the
table measures round trips the way a real bucket charges them. The store is filled
directly (not through the proxy): one real checkpoint, then its commit record and rank
record re-sealed for every step, with a validation record each.

Measured: the landing sensor's tick when nothing is new (and the full listing it does
every ``FULL_SCAN_S``); the inventory (every checkpoint,
its records); ``ckptflow ls``; a restore of the newest checkpoint. Cold is the first time
(no index yet), warm the next (listing-validated indexes: ``ckptflow/catalog/object_index.py``).

Then the Dagster side (``partitions.py``): both automation sensors' ticks at
``--partitions`` partitions and retention dropping ``--expire`` of them. One table at the end.

Run: ``.venv/bin/python benchmarks/scale.py --checkpoints 10000 --partitions 40000``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import partitions  # noqa: E402
import torch  # noqa: E402
from _latency_proxy import LatencyProxy  # noqa: E402

from ckptflow import Checkpointer  # noqa: E402
from ckptflow.catalog.verdicts import Subject, record_key  # noqa: E402
from ckptflow.cli import main as cli  # noqa: E402
from ckptflow.format import layout as fmt  # noqa: E402
from ckptflow.format.sealed import seal  # noqa: E402
from ckptflow.reports import inventory  # noqa: E402
from ckptflow.store import open_store  # noqa: E402
from ckptflow.store.s3 import S3Store  # noqa: E402

RUN = "scale"
TARGETS = {  # issue 14's acceptance figures, by the row names below
    "landing tick, nothing new": "<= 2 s",
    "ckptflow ls (warm)": "<= 5 s",
    "inventory (warm)": "<= 20 s",
    "restore newest": "<= 1 s + chunk reads",
    "lifecycle_automation tick": "< the sensor interval (15 s)",
    "evaluation_automation tick": "< the sensor interval (15 s)",
    "retention: drop": "<= 30 s (+ the store's deletes)",
}
BUCKET = "ckptflow-scale"


def template(tmp: str) -> tuple[dict, dict, dict[str, bytes]]:
    """A real one-rank checkpoint: its manifest, its rank record, its chunk objects."""
    with Checkpointer(tmp, RUN) as ck:
        ck.save(0, {"model": {"w": torch.arange(256, dtype=torch.float32)}, "epoch": 0})
    store = open_store(tmp)
    manifest = json.loads(store.get(fmt.manifest_key(RUN, 0)))
    [rank_key] = [i.key for i in store.list(fmt.step_prefix(RUN, 0) + "ranks/")]
    rank = json.loads(store.get(rank_key))
    chunks = {i.key: store.get(i.key) for i in store.list("chunks/")}
    return manifest, rank, chunks


def fill(client, prefix: str, count: int, tmp: str) -> None:
    manifest, rank, chunks = template(tmp)
    for doc in (manifest, rank):
        doc.pop("checksum")
    now = time.time() - 86400

    def objects(step: int) -> list[tuple[str, bytes]]:
        save_id = uuid.uuid4().hex
        m = {**manifest, "step": step, "save_id": save_id, "created_at": now + step, "committed_at": now + step,
             "metadata": {"val_loss": 1.0 / (step + 1)}}  # fmt: skip
        blob = seal(m)
        r = seal({**rank, "step": step, "save_id": save_id})
        subject = Subject(RUN, step, fmt.digest_of(blob))
        verdict = json.dumps({"ok": True, "manifest_digest": subject.digest, "recorded_at": now + step + 5}).encode()
        return [(fmt.manifest_key(RUN, step), blob), (fmt.rank_key(RUN, step, 0, save_id), r),
                (record_key(subject, "validation"), verdict)]  # fmt: skip

    def put(item: tuple[str, bytes]) -> None:
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{item[0]}", Body=item[1])

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(put, chunks.items()))
        list(pool.map(put, (o for step in range(1, count + 1) for o in objects(step))))


@contextlib.contextmanager
def s3_server():
    """moto's S3 server (``_s3_server.py``: listings paged the way a real bucket pages
    them) in a process of its own: its work is not charged to the process under measurement."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_s3_server.py")), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield endpoint
    finally:
        server.terminate()
        server.wait()


def timed(fn, profile: str | None = None) -> float:
    """Seconds ``fn`` took; with ``profile`` its cProfile statistics are written there."""
    import cProfile

    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    fn()
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - started
    if profiler:
        profiler.dump_stats(profile)  # type: ignore[arg-type]
    return seconds


def measure(
    url: str, store: S3Store, proxy: LatencyProxy, count: int, profile: str | None
) -> list[tuple[str, float, float, int]]:
    from ckptflow.lifecycle.landing import new_commits

    rows = []

    def row(name: str, fn) -> None:
        before, cpu = proxy.requests, time.process_time()
        where = os.path.join(profile, f"{len(rows)}.prof") if profile else None
        seconds = timed(fn, where)
        rows.append((name, seconds, time.process_time() - cpu, proxy.requests - before))
        print(f"  {name}: {seconds:.2f} s ({rows[-1][2]:.2f} s CPU), {rows[-1][3]} requests", flush=True)

    quiet = contextlib.redirect_stdout(io.StringIO())
    cursor = {"t": time.time() + 3600, "seen": []}  # everything landed already
    row("landing tick, full listing (every 5 min)", lambda: cursor.update(new_commits(store, cursor, 500)[1]))
    row("landing tick, nothing new", lambda: new_commits(store, cursor, 500))
    row("ckptflow ls (cold: no index)", lambda: _quiet(quiet, lambda: cli(["ls", url])))
    row("ckptflow ls (warm)", lambda: _quiet(quiet, lambda: cli(["ls", url])))
    row("inventory (records cold)", lambda: inventory.collect(store))
    row("inventory (warm)", lambda: inventory.collect(store))
    state = {"model": {"w": torch.zeros(256)}, "epoch": -1}
    with Checkpointer(store, RUN, restore_rng=False) as ck:
        row("restore newest", lambda: ck.restore(state))
    assert state["epoch"] == 0 and len(list(inventory.collect(store))) == count
    return rows


def _quiet(redirect, fn) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        fn()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=10_000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--partitions", type=int, default=40_000, help="for the automation ticks (partitions.py)")
    parser.add_argument("--expire", type=int, default=10_000, help="partitions retention drops (partitions.py)")
    parser.add_argument("--profile", metavar="DIR", help="write each operation's cProfile statistics here")
    args = parser.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    import boto3

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "scale")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with s3_server() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            fill(client, "store", args.checkpoints, tmp)
            print(f"filled {args.checkpoints} checkpoints in {time.perf_counter() - started:.0f} s (no latency)")
        with LatencyProxy(endpoint, args.latency_ms / 1000) as proxy:
            url = f"s3://{BUCKET}/store?endpoint={proxy.url}"
            rows = measure(url, open_store(url), proxy, args.checkpoints, args.profile)  # type: ignore[arg-type]
    print(f"Dagster: {args.partitions} partitions, {args.expire} of them dropped by retention", flush=True)
    rows += [(name, seconds, None, None) for name, seconds in partitions.measure(args.partitions, args.expire)]
    print(
        f"\n{args.checkpoints} checkpoints on S3 ({args.latency_ms:g} ms per request), {args.partitions} partitions:\n"
    )
    print("| operation | seconds | client CPU s | S3 requests | target |\n|---|---:|---:|---:|---|")
    for name, seconds, cpu, requests in rows:
        target = next((t for prefix, t in TARGETS.items() if name.startswith(prefix)), "")
        cpu_text, requests_text = ("", "") if requests is None else (f"{cpu:.2f}", str(requests))
        print(f"| {name} | {seconds:.2f} | {cpu_text} | {requests_text} | {target} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
