"""How long ``retention_job``'s GC waits for saves in flight: the retention resource's
``gc_wait`` (``CKPTFLOW_RETENTION``), which it called ``gc`` with no way to set, so an
async upload longer than the default 60 s skipped most of its GCs (``gc_skipped``)."""

import threading
import time

import pytest
from dagster import DagsterEventType

from ckptflow.chunks import leases
from ckptflow.store import open_store


def _lease_held_for(root: str, seconds: float) -> threading.Thread:
    """A save's lease, taken now (before this returns) and released ``seconds`` later, as a
    save in flight then committing holds it."""
    taken = threading.Event()

    def hold() -> None:
        with leases.save_lease(open_store(root)):
            taken.set()
            time.sleep(seconds)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(30), "the lease was not taken"
    return thread


@pytest.mark.parametrize("gc_wait, sweeps", [("5s", True), ("0s", False)])
def test_the_retention_jobs_gc_waits_as_long_as_the_policy_says(
    store_with_checkpoints, defs_with_retention, instance, gc_wait, sweeps
):
    """A save in flight commits 1.5 s after the job starts: waiting 5 s, the GC sweeps
    after it; waiting 0 s, it skips, saying why (the job's metadata shows the wait)."""
    defs = defs_with_retention(gc_grace="0s", gc_wait=gc_wait)
    saving = _lease_held_for(store_with_checkpoints, 1.5)
    result = defs.resolve_job_def("retention_job").execute_in_process(instance=instance)
    saving.join(30)
    assert result.success
    out = result.output_for_node("apply_retention")
    assert (out["gc_skipped"] is None) == sweeps, out["gc_skipped"]
    if not sweeps:
        assert "save" in out["gc_skipped"], out["gc_skipped"]
    [output] = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_OUTPUT]
    assert output.event_specific_data.metadata["gc_wait_s"].value == float(gc_wait[:-1])
