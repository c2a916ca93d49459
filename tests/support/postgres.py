"""A real PostgreSQL server for a test, from the machine's ``postgresql`` package.

``initdb`` into a fresh directory (as the ``postgres`` user when we are root: initdb
refuses root), a free port on 127.0.0.1, a database for Dagster; stopped and removed
at the end. Skips, saying why, only where no PostgreSQL server binaries exist.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

DB = "dagster"
USER = "postgres"


@dataclass(frozen=True)
class Postgres:
    host: str
    port: int
    db: str
    user: str

    def env(self) -> dict[str, str]:
        """What ``pipelines/instance/production.yaml`` reads."""
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_DB": self.db,
            "DAGSTER_PG_USERNAME": self.user,
            "DAGSTER_PG_PASSWORD": "",
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindir() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


def _as_server_user(command: list[str]) -> list[str]:
    return ["runuser", "-u", USER, "--", *command] if os.geteuid() == 0 else command


@contextlib.contextmanager
def postgres_server() -> Iterator[Postgres]:
    bindir = _bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb); install the `postgresql` package")
    data = tempfile.mkdtemp(prefix="ckptflow-pg-")
    if os.geteuid() == 0:
        account = pwd.getpwnam(USER)
        os.chown(data, account.pw_uid, account.pw_gid)
    port = free_port()
    run = lambda *cmd: subprocess.run(_as_server_user(list(cmd)), check=True, capture_output=True, text=True)
    try:
        run(f"{bindir}/initdb", "-D", data, "-U", USER, "--auth=trust", "-E", "UTF8", "--no-instructions")
        options = f"-p {port} -k {data} -c listen_addresses=127.0.0.1 -c fsync=off"
        run(f"{bindir}/pg_ctl", "-D", data, "-o", options, "-l", f"{data}/server.log", "-w", "start")
        try:
            run(f"{bindir}/createdb", "-h", "127.0.0.1", "-p", str(port), "-U", USER, DB)
            yield Postgres("127.0.0.1", port, DB, USER)
        finally:
            run(f"{bindir}/pg_ctl", "-D", data, "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(data, ignore_errors=True)
