"""What the exit says of async saves (``ckptflow.training.save_handle``): a save that failed
and that nobody waited for is reported, whether it failed before the exit or during its wait."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.child_env import child_env

TESTS = Path(__file__).resolve().parents[1]

FAILING_STORE = (
    "import sys, time, torch\n"
    "from ckptflow import Checkpointer\n"
    "from ckptflow.chunks.io import ChunkStore\n"
    "from ckptflow.errors import StoreUnavailableError\n"
    "def put(self, *a, **k):\n"
    "    time.sleep({delay})\n"
    "    raise StoreUnavailableError('injected: the store went away')\n"
    "ChunkStore.put = put\n"
    "ck = Checkpointer({root!r}, 'run')\n"
    "handle = ck.save(7, {{'w': torch.randn(1 << 16)}}, blocking=False)\n"
    "{then}\n"
)

ENDS = {
    # the save failed while training went on, and the script ended without waiting for it
    "failed before the exit": {"delay": 0, "then": "time.sleep(1); assert handle.done()"},
    # the exit waits for the save, which fails meanwhile (DCP wraps it in a BaseException)
    "fails during the exit": {"delay": 1, "then": "assert not handle.done()"},
}


def run_script(tmp_path, **fields) -> tuple[str, subprocess.CompletedProcess]:
    """The failing-store script, with ``fields``, in a child Python: (its store root, how it ended)."""
    root = str(tmp_path / "store")
    script = FAILING_STORE.format(root=root, **fields)
    done = subprocess.run(
        [sys.executable, "-c", script], env=child_env(TESTS.parent), capture_output=True, text=True, timeout=120
    )
    return root, done


@pytest.mark.parametrize("end", sorted(ENDS))
def test_an_async_save_that_failed_unwaited_is_reported_at_exit(tmp_path, end):
    """Before: the first case exited without a word; in the second, the hook's ``except
    Exception`` missed DCP's ``CheckpointException`` and Python printed a raw traceback
    instead of the message saying the save was not committed. And the process exited 0: a
    scheduler saw a job that succeeded with its last checkpoint lost, and restarted nothing."""
    end_fields = {**ENDS[end], "then": ENDS[end]["then"] + "\nprint('the script ended', file=sys.stderr)"}
    root, done = run_script(tmp_path, **end_fields)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "the script ended" in done.stderr  # the status is the exit's, not a failure of the script
    assert (
        f"the async save of run 'run' step 7 in file://{root} failed and was not committed: "
        "injected: the store went away"
    ) in done.stderr, done.stderr[-3000:]
    assert "save step 7 again" in done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]


def test_a_failure_already_raised_by_wait_is_not_reported_again_at_exit(tmp_path):
    then = "try:\n    handle.wait()\nexcept StoreUnavailableError:\n    print('raised by wait', file=sys.stderr)"
    _, done = run_script(tmp_path, delay=0, then=then)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "raised by wait" in done.stderr
    assert "was not committed" not in done.stderr, done.stderr[-3000:]


def test_the_scripts_own_atexit_handlers_run_before_a_lost_save_ends_the_process(tmp_path):
    """Status 1 comes from ``os._exit``: the handlers registered with ``atexit`` (a logger's
    flush, a metrics upload) must still run, as at any exit."""
    then = "import atexit\natexit.register(lambda: print('handler ran', file=sys.stderr))"
    _, done = run_script(tmp_path, delay=0, then=then)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "was not committed" in done.stderr
    assert done.stderr.rstrip().endswith("handler ran"), done.stderr[-3000:]


def test_a_lost_save_lets_the_scripts_own_threads_finish_before_the_process_ends(tmp_path):
    """Before: ``os._exit`` ran from the threading exit hook, before the interpreter joins the
    threads that are not daemons: a thread still writing the script's results was cut off."""
    then = (
        "import threading\n"
        "def late():\n"
        "    time.sleep(1.5)\n"
        "    print('thread finished', file=sys.stderr)\n"
        "threading.Thread(target=late).start()"
    )
    _, done = run_script(tmp_path, delay=0, then=then)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "was not committed" in done.stderr
    assert "thread finished" in done.stderr, done.stderr[-3000:]
