"""A real MLflow tracking server for tests: ``mlflow server`` on 127.0.0.1, a SQLite backend
and a local artifact root (served by the server, so clients upload over HTTP as they would
to a team's server), started once per session."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from support.postgres import free_port

START_TIMEOUT_S = 180  # the server imports MLflow and migrates its database first (slow on a busy machine)


@contextmanager
def mlflow_server(root: str) -> Iterator[str]:
    """Run ``mlflow server`` with its state under ``root``; yields its URL."""
    port = free_port()
    mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
    log = open(os.path.join(root, "server.log"), "wb")
    server = subprocess.Popen(
        [
            mlflow, "server",
            "--backend-store-uri", f"sqlite:///{os.path.join(root, 'mlflow.db')}",
            "--artifacts-destination", os.path.join(root, "artifacts"),
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        ],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {server.returncode}: see {root}/server.log")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not answer in {START_TIMEOUT_S} s: see {root}/server.log")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
