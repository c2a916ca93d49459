"""The retention job settles a conditional delete killed mid-way before its GC marks: a
commit record the delete had taken aside (``.<name>.aside-<sha>-<id>``, a version it was
not to delete) is put back, logged, and counted in the job's ``gc_restored``."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
from pathlib import Path

from dagster import DagsterEventType

from assets import checkpoint_key
from ckptflow.catalog import checkpoints as catalog
from ckptflow.format import layout as fmt
from ckptflow.store import local_cas, open_store
from support.child_env import child_env
from support.dagster import RUN

TESTS = Path(__file__).resolve().parents[1]


def test_the_retention_job_puts_back_a_commit_a_killed_delete_took_aside(
    store_with_checkpoints, defs, instance, tmp_path, monkeypatch
):
    """Step 40 committed again (``recommit``) between a conditional delete's compare (of an
    older commit at the step) and its rename; the delete is SIGKILLed after the rename, so
    the recommit lies aside under the older commit's version and step 40 looks gone."""
    root = Path(store_with_checkpoints)
    key = fmt.manifest_key(RUN, 40)
    path = root / key
    recommit = tmp_path / "recommit.json"
    recommit.write_bytes(path.read_bytes())
    older = b'{"the commit at step 40 the delete was to remove": true}'
    path.write_bytes(older)
    child = subprocess.run(
        [sys.executable, str(TESTS / "support" / "killed_delete.py"), str(root), key,
         hashlib.sha256(older).hexdigest(), str(recommit)],
        env=child_env(TESTS.parent), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    [aside] = path.parent.glob(f".{path.name}.aside-*")
    assert not path.exists() and aside.read_bytes() == recommit.read_bytes()
    instance.add_dynamic_partitions("checkpoints", [checkpoint_key(RUN, s) for s in (10, 20, 30, 40)])

    monkeypatch.setattr(local_cas, "ASIDE_SETTLED_S", 0.0)  # as if the delete had been killed a minute ago
    result = defs.resolve_job_def("retention_job").execute_in_process(instance=instance)

    assert result.success
    assert path.read_bytes() == recommit.read_bytes() and not aside.exists()  # the commit is back
    assert catalog.verify_checkpoint(open_store(str(root)), RUN, 40).ok
    [output] = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_OUTPUT]
    assert output.event_specific_data.metadata["gc_restored"].value == 1
    warned = [e.user_message for e in instance.all_logs(result.run_id) if "GC put back" in e.user_message]
    assert warned == [f"GC put back {key}: a conditional delete killed mid-way had taken it aside"]
    assert checkpoint_key(RUN, 40) in instance.get_dynamic_partitions("checkpoints")
