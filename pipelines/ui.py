"""``python -m pipelines.ui`` (what `make ui` runs): ``dagster dev`` that stops when asked.

Started in the background (``make ui &``), a shell hands its children SIGINT ignored, and
``dagster dev`` inherits that; a SIGTERM reaches only the ``sh -c`` that make started, so the
webserver, the daemon and the code servers stayed until SIGKILL. This launcher runs
``dagster dev`` in its own process group with SIGINT restored, and on SIGINT or SIGTERM (or
when make, its parent, goes away) asks that whole group to stop: SIGINT first (dagster's
clean shutdown), SIGTERM after ``GRACE_S``, SIGKILL after twice that. Its pid is written to
``$DAGSTER_HOME/ui.pid`` so that ``make ui-stop`` (a SIGTERM to it) works from anywhere.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

GRACE_S = 15.0
POLL_S = 0.5


def _restore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop_group(process: subprocess.Popen, *, grace_s: float) -> int:
    """Ask the process group to stop, more firmly as time passes; the exit status."""
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
            if sig is not signal.SIGKILL:
                _reap_group(process.pid, grace_s=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue
    return process.wait()


def _reap_group(pgid: int, *, grace_s: float) -> None:
    """Children ``dagster dev`` left behind (it exits before its webserver and daemon do)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(POLL_S)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", default="3000")
    args = parser.parse_args(argv)
    home = os.environ.get("DAGSTER_HOME")
    if not home:
        print("pipelines.ui: DAGSTER_HOME is not set; start it with `make ui`", file=sys.stderr)
        return 2
    dagster = os.path.join(os.path.dirname(sys.executable), "dagster")
    command = [dagster, "dev", "-w", "workspace.yaml", "-h", args.host, "-p", args.port]
    stop_requested: list[int] = []

    def request_stop(signum: int, _frame: object) -> None:
        stop_requested.append(signum)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    parent = os.getppid()
    pid_file = os.path.join(home, "ui.pid")
    with open(pid_file, "w") as f:
        f.write(f"{os.getpid()}\n")
    print(
        f"Dagster UI on http://{args.host}:{args.port} (stop: Ctrl-C, `make ui-stop`, or kill {os.getpid()})",
        flush=True,
    )
    process = subprocess.Popen(command, start_new_session=True, preexec_fn=_restore_sigint)
    try:
        while process.poll() is None and not stop_requested and os.getppid() == parent:
            time.sleep(POLL_S)
        if process.poll() is not None:
            _reap_group(process.pid, grace_s=GRACE_S)
            return process.returncode
        print("Stopping the Dagster UI (webserver, daemon, code servers)...", flush=True)
        _stop_group(process, grace_s=GRACE_S)
        return 0
    finally:
        if os.path.exists(pid_file):
            os.unlink(pid_file)


if __name__ == "__main__":
    raise SystemExit(main())
