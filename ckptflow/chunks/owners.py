"""Who holds a lease or a lock: the body each holder writes (``body``), and whether a
holder that ran on this machine is gone (``gone``), for ``ckptflow.chunks.leases``.

A body names the machine (the kernel's boot id and the PID namespace, so a pid means the
same process only where both match), the pid and the process's start time
(``/proc/<pid>/stat`` field 22, so a pid reused by another process is not mistaken for
it), and a holder token (``id``): an exclusive lock's holder writes the same token in
every renewal, so a holder that does not know its lock's version can tell its own lock
from another holder's.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path


def body(what: str, token: str | None = None) -> bytes:
    """A lease's or lock's body; ``id`` is ``token`` (an exclusive lock's holder keeps one
    token for all its renewals) or a fresh one."""
    return json.dumps({"what": what, "host": socket.gethostname(), "pid": os.getpid(), "id": token or uuid.uuid4().hex,
                       "time": time.time(), **this_process()}).encode()  # fmt: skip


def token(body: bytes) -> str | None:
    """The holder token (``id``) of a lock ``body``; None if it has none (damaged, another writer's)."""
    try:
        found = json.loads(body).get("id")
    except (ValueError, TypeError, AttributeError, RecursionError):
        return None
    return found if isinstance(found, str) else None


def this_process() -> dict:
    """This process as a GC on the same machine can check it: ``machine`` (boot id and PID
    namespace) and ``started`` (clock ticks after boot). Empty off Linux, or where /proc
    is not this process's own (its pid there differs from ``os.getpid()``)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
        pid, _state, started = proc_stat("self")
    except (OSError, ValueError, IndexError):
        return {}
    return {"machine": f"{boot} {namespace}", "started": started} if pid == os.getpid() else {}


def proc_stat(pid: str) -> tuple[int, str, int]:
    """Pid, state and start time from ``/proc/<pid>/stat`` (fields 1, 3 and 22; the command
    name, field 2, may hold spaces and parentheses, so fields are counted after its last ')')."""
    line = Path(f"/proc/{pid}/stat").read_text()
    fields = line[line.rindex(")") + 2 :].split()
    return int(line.split(" ", 1)[0]), fields[0], int(fields[19])


def gone(body: bytes) -> bool:
    """Whether the process that wrote the lease ``body`` ran on this machine and is gone: no
    such pid, a zombie (killed, not yet reaped), or another process under its pid. Only
    what this machine can see counts; anything else (another machine, an old lease
    without the fields, a process whose stat cannot be read) is left to ``DEAD_AFTER``."""
    try:
        holder = json.loads(body)
        machine, pid, started = holder["machine"], holder["pid"], holder["started"]
    except (ValueError, TypeError, KeyError, RecursionError):  # a body nested deep is no holder either
        return False
    if type(pid) is not int or not 0 < pid < 1 << 31 or machine != this_process().get("machine"):  # a pid_t
        return False
    try:
        os.kill(pid, 0)  # signal 0 only asks whether the pid exists
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: it exists
        pass
    try:
        _pid, state, now = proc_stat(str(pid))
    except (OSError, ValueError, IndexError):
        return False
    return state in ("Z", "X") or now != started
