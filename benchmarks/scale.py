#!/usr/bin/env python
"""`make scale`: a store of 10,000 checkpoints on S3 behind 20 ms of latency per request.

A local S3 server (moto) holds the store; every request of the code under test goes
through an HTTP proxy on 127.0.0.1 that holds it for ``--latency-ms`` first, so the
table measures round trips the way a real bucket charges them. The store is filled
directly (not through the proxy): one real checkpoint, then its commit record and rank
record re-sealed for every step, with a validation record each.

Measured: the landing sensor's tick when nothing is new; the inventory (every checkpoint,
its records); ``ckptflow ls``; a restore of the newest checkpoint. Cold is the first time
(no index yet), warm the next (listing-validated indexes: ``ckptflow/index.py``).

Run: ``.venv/bin/python benchmarks/scale.py --checkpoints 10000``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from _latency_proxy import LatencyProxy  # noqa: E402

from ckptflow import Checkpointer, inventory  # noqa: E402
from ckptflow import format as fmt  # noqa: E402
from ckptflow.cli import main as cli  # noqa: E402
from ckptflow.lifecycle.records import Subject, record_key  # noqa: E402
from ckptflow.sealed import seal  # noqa: E402
from ckptflow.store import open_store  # noqa: E402
from ckptflow.store.s3 import S3Store  # noqa: E402

RUN = "scale"
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


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(url: str, store: S3Store, proxy: LatencyProxy, count: int) -> list[tuple[str, float, int]]:
    from sensors.landing import new_commits

    rows = []

    def row(name: str, fn) -> None:
        before = proxy.requests
        rows.append((name, timed(fn), proxy.requests - before))
        print(f"  {name}: {rows[-1][1]:.2f} s, {rows[-1][2]} requests", flush=True)

    quiet = contextlib.redirect_stdout(io.StringIO())
    row("landing tick, nothing new", lambda: new_commits(store, {"t": time.time() + 3600, "seen": []}, 500))
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
    args = parser.parse_args()
    import boto3
    from moto.server import ThreadedMotoServer

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "scale")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=BUCKET)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        fill(client, "store", args.checkpoints, tmp)
        print(f"filled {args.checkpoints} checkpoints in {time.perf_counter() - started:.0f} s (directly, no latency)")
    with LatencyProxy(endpoint, args.latency_ms / 1000) as proxy:
        url = f"s3://{BUCKET}/store?endpoint={proxy.url}"
        rows = measure(url, open_store(url), proxy, args.checkpoints)  # type: ignore[arg-type]
    server.stop()
    print(f"\n{args.checkpoints} checkpoints on S3, {args.latency_ms:g} ms per request:\n")
    print("| operation | seconds | requests |\n|---|---:|---:|")
    for name, seconds, requests in rows:
        print(f"| {name} | {seconds:.2f} | {requests} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
