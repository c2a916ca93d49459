"""`make ui` started in the background stops on a SIGTERM to make and on `make ui-stop`.

A shell starts background jobs with SIGINT ignored, and ``dagster dev`` used to inherit that
and outlive a SIGTERM to make (its webserver and daemon stayed until SIGKILL). Each case starts
the real `make ui` the way ``make ui &`` does (SIGINT ignored), waits until the webserver
answers, stops it, and asserts that no process of that tree is left.

Slow (two real `dagster dev` start-ups): ``make test-e2e`` runs it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request

import pytest

from pipelines.demo import daemon
from support.postgres import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _answers(base: str) -> bool:
    try:
        return urllib.request.urlopen(base + "/server_info", timeout=5).status == 200
    except OSError:
        return False


def _processes() -> dict[int, tuple[int, str]]:
    """Every live (not zombie) process: pid -> (parent pid, command line)."""
    table = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        if state != "Z":
            table[int(pid)] = (int(ppid), command)
    return table


def _tree(root: int) -> set[int]:
    """``root`` and every process below it (the launcher puts ``dagster dev`` in a session
    of its own, so a session or group id would miss it)."""
    table, tree = _processes(), {root}
    grew = True
    while grew:
        below = {pid for pid, (ppid, _) in table.items() if ppid in tree} - tree
        tree |= below
        grew = bool(below)
    return tree & set(table)


def _alive(pids: set[int]) -> list[str]:
    table = _processes()
    return [f"{pid}: {table[pid][1]}" for pid in sorted(pids) if pid in table]


@pytest.fixture
def started_ui(tmp_path):
    """`make ui` as ``make ui &`` starts it; yields (make's process, base URL, home)."""
    home, port = str(tmp_path / "dagster_home"), free_port()
    log = open(tmp_path / "make-ui.log", "w")

    def like_a_background_job() -> None:
        """What a shell's ``make ui &`` gets, whatever this process set: a pytest started in the
        background has SIGINT ignored, and Dagster's interrupt set-up (run in-process by earlier
        tests) maps SIGTERM to SIGINT's disposition, so SIGTERM would be inherited ignored too,
        and GNU make keeps ignoring a signal it started with ignored."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])

    make = subprocess.Popen(
        ["make", "ui", f"UI_HOME={home}", f"UI_PORT={port}"],
        cwd=daemon.REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=like_a_background_job,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        assert daemon.wait_until(lambda: _answers(base), timeout_s=240), (tmp_path / "make-ui.log").read_text()[-3000:]
        yield make, base, home
    finally:
        for pid in _tree(make.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def _all_gone(pids: set[int], base: str) -> None:
    assert daemon.wait_until(lambda: not _alive(pids), timeout_s=60), _alive(pids)
    assert not _answers(base)


def test_sigterm_to_make_stops_the_whole_ui(started_ui):
    make, base, _home = started_ui
    ui = _tree(make.pid)
    assert len(ui) >= 4, ui  # make, the launcher, dagster dev, its webserver and daemon
    make.send_signal(signal.SIGTERM)
    _all_gone(ui, base)


def test_make_ui_stop_stops_a_background_ui(started_ui):
    make, base, home = started_ui
    assert os.path.exists(os.path.join(home, "ui.pid"))
    ui = _tree(make.pid)
    stop = subprocess.run(["make", "ui-stop", f"UI_HOME={home}"], cwd=daemon.REPO, capture_output=True, text=True)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "asked the Dagster UI to stop" in stop.stdout
    _all_gone(ui, base)
    assert make.wait(timeout=10) == 0
    assert not os.path.exists(os.path.join(home, "ui.pid"))
