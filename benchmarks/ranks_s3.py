#!/usr/bin/env python
"""Save throughput per rank against S3 for 1, 2 and 4 gloo ranks, in one run.

Every rank holds ``--mb-per-rank`` MiB of fp32 weights, its Shard(0) of one DTensor
(weak scaling: more ranks, more bytes, the same share each), and saves them full
(every chunk rewritten, the commit included) ``--saves`` times to a bucket on a local S3
server (moto, in this process), optionally behind the latency proxy
(``_latency_proxy.py``: ``--latency-ms`` per request, as a remote bucket charges it).
Each configuration starts from an empty server, so none reads or fills another's bucket.

Per configuration: the median save (rank 0's wall time, barrier to commit), MiB/s per
rank, MiB/s of all ranks together, per-rank throughput as a ratio to one rank's, and the
requests the proxy passed per save.

Run: ``.venv/bin/python benchmarks/ranks_s3.py`` (``make scale`` runs it)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1 << 20
BUCKET = "ckptflow-ranks"


def _rank(rank: int, world: int, port: int, url: str, mb: int, saves: int, chunk_mb: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ckptflow import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    mesh = init_device_mesh("cpu", (world,))
    rows = mb * MiB // (4 * 1024)
    local = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rank))
    state = {"model": {"w": DTensor.from_local(local, mesh, [Shard(0)])}}
    times = []
    with Checkpointer(url, run=f"world{world}", chunk_bytes=chunk_mb * MiB) as ck:
        for step in range(saves + 1):  # step 0 warms up: connections, thread pools
            local.add_(1.0)  # new bytes every save
            dist.barrier()
            started = time.perf_counter()
            ck.save(step, state, kind="full")
            if step:
                times.append(time.perf_counter() - started)
    out.put((rank, times))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(procs: list, out: mp.Queue) -> dict[int, list[float]]:
    """Every rank's save times; a rank that died (its traceback is on stderr) stops the run."""
    results: dict[int, list[float]] = {}
    while len(results) < len(procs):
        try:
            rank, times = out.get(timeout=1.0)
            results[rank] = times
        except queue.Empty:
            if any(p.exitcode for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}") from None
    for p in procs:
        p.join(60)
    return results


def measure(world: int, args: argparse.Namespace, latency_ms: float, endpoint: str) -> dict:
    import boto3
    from _latency_proxy import LatencyProxy

    # moto keeps its buckets in this process, across servers: empty them for each configuration
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).read()
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    proxy = LatencyProxy(endpoint, latency_ms / 1000) if latency_ms else None
    with proxy or contextlib.nullcontext():
        url = f"s3://{BUCKET}/store?endpoint={proxy.url if proxy else endpoint}"
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        gloo = _free_port()
        procs = [
            ctx.Process(target=_rank, args=(r, world, gloo, url, args.mb_per_rank, args.saves, args.chunk_mb, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = _collect(procs, out)
        requests = proxy.requests if proxy else None
    save_s = statistics.median(results[0])
    return {
        "latency_ms": latency_ms,
        "ranks": world,
        "save_s": save_s,
        "per_rank": args.mb_per_rank / save_s,
        "all": world * args.mb_per_rank / save_s,
        "requests": None if requests is None else requests / (args.saves + 1),
    }


def table(rows: list[dict], mb: int) -> str:
    lines = [
        "| latency per request | ranks | MiB per rank | save s (median) | MiB/s per rank | MiB/s all ranks "
        "| per rank vs 1 rank | requests per save |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    one = {r["latency_ms"]: r["per_rank"] for r in rows if r["ranks"] == 1}
    for r in rows:
        base = one.get(r["latency_ms"])
        ratio = f"{r['per_rank'] / base:.2f}x" if base else "-"
        requests = "-" if r["requests"] is None else f"{r['requests']:.0f}"
        lines.append(
            f"| {r['latency_ms']:g} ms | {r['ranks']} | {mb} | {r['save_s']:.3f} | {r['per_rank']:.1f} "
            f"| {r['all']:.1f} | {ratio} | {requests} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--mb-per-rank", type=int, default=32)
    parser.add_argument("--chunk-mb", type=int, default=8, help="Checkpointer chunk_bytes in MiB (default 8)")
    parser.add_argument("--saves", type=int, default=3, help="timed saves per configuration (median reported)")
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0])
    args = parser.parse_args()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import torch
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    rows = []
    try:
        for latency in args.latency_ms:
            for world in args.ranks:
                rows.append(measure(world, args, latency, f"http://{host}:{port}"))
                r = rows[-1]
                print(
                    f"  {latency:g} ms, {world} ranks: {r['save_s']:.3f} s per save, {r['per_rank']:.1f} MiB/s per rank"
                )
    finally:
        server.stop()
    load = os.getloadavg()[0]
    print(
        f"\nmachine: {os.cpu_count()} CPUs (load average {load:.1f} at the end), torch {torch.__version__}; "
        f"S3: moto in this process{' behind the latency proxy' if any(args.latency_ms) else ''}; "
        f"{args.chunk_mb} MiB chunks, sync full saves, median of {args.saves}\n"
    )
    print(table(rows, args.mb_per_rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
