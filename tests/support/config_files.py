"""A file a setting names (``ckptflow.policy.config_files``) that would never be read to its
end: ``/dev/zero`` tried in a child whose address space is capped (without the bound it
fails with a MemoryError rather than take the machine's memory), and a FIFO no process
writes (without the bound ``open`` blocks forever: the call runs in a thread, unblocked
afterwards by opening the FIFO's other end)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.child_env import child_env

REPO = Path(__file__).resolve().parents[2]
CAPPED = 4 << 30  # address space of the child: the imports fit, an endless read does not


def capped_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CAPPED, CAPPED))

    return subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(REPO, **env),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=cap,
    )


def call_with_unwritten_fifo(fifo: Path, call: Callable[[], Any], *, within: float) -> BaseException | None:
    """What ``call`` raised (None if it returned) while ``fifo`` has no writer; fails the
    test if it is still blocked after ``within`` seconds."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as e:  # handed to the test
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    blocked = thread.is_alive()
    if blocked:  # unblock it: a writer that opens and closes the FIFO ends the read
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
    assert not blocked, f"still blocked on the FIFO {fifo} after {within} s"
    return outcome[0]


def load_error_from_unwritten_fifo(
    tmp_path: Path, monkeypatch, env: str, load: Callable[[], Any]
) -> tuple[Path, BaseException | None]:
    """The FIFO, no process writing it, that the setting ``env`` names, and what ``load``
    raised (the wait for a pipe, ``config_files.PIPE_WAIT_S``, cut to 0.5 s)."""
    from ckptflow.policy import config_files

    fifo = tmp_path / f"{env.lower()}.fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(config_files, "PIPE_WAIT_S", 0.5)
    monkeypatch.setenv(env, str(fifo))
    return fifo, call_with_unwritten_fifo(fifo, load, within=10)
