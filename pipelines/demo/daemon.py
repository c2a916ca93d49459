"""The real path: ``dagster-daemon`` carrying freshly committed checkpoints through the
lifecycle, watched from outside.

``make demo`` ends with this (and ``tests/dagster/test_daemon.py`` asserts on the same
observations): start ``dagster-daemon run`` as its own process on the demo's instance,
let a separate training process (``pipelines.demo.regressor``: another model, its own
metrics) commit checkpoints, the newest corrupted, and read off the instance when each
one was validated, evaluated, compressed and archived, and that the corrupt one was
blocked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dagster import AssetKey, AssetPartitionStatus, AssetRecordsFilter, DagsterInstance

from assets.checkpoints import INTEGRITY_KEY
from assets.partitions import checkpoint_key, checkpoints_partitions
from ckptflow.catalog import checkpoints as catalog
from ckptflow.store import open_store
from resources.dagster_private import latest_check_passed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOWNSTREAM = ("checkpoint", "evaluation", "compressed", "archived")


@dataclass
class Outcome:
    """What the instance says about one commit: when each asset materialized (seconds
    after the commit) and the integrity check's verdict."""

    key: str
    committed_at: float
    after_s: dict[str, float] = field(default_factory=dict)
    check_passed: bool | None = None
    failed: bool = False  # the checkpoint partition is Failed (the check blocked it)

    @property
    def complete(self) -> bool:
        return set(self.after_s) == set(DOWNSTREAM)

    @property
    def blocked(self) -> bool:
        return self.check_passed is False and self.failed and not self.after_s


def observe(instance: DagsterInstance, root: str, run: str) -> list[Outcome]:
    """Every committed checkpoint of ``run`` in the store at ``root``, as the instance sees it."""
    out = []
    for info in catalog.list_checkpoints(open_store(root), run):
        key = checkpoint_key(run, info.step)
        outcome = Outcome(key, info.created_at)
        for asset in DOWNSTREAM:
            records = instance.fetch_materializations(
                AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[key]), limit=1
            ).records
            if records:
                outcome.after_s[asset] = records[0].timestamp - info.created_at
        outcome.check_passed = latest_check_passed(instance, INTEGRITY_KEY, key)
        status = instance.get_status_by_partition(AssetKey("checkpoint"), [key], checkpoints_partitions) or {}
        outcome.failed = status.get(key) == AssetPartitionStatus.FAILED
        out.append(outcome)
    return out


def settled(outcomes: list[Outcome], corrupt: set[str]) -> bool:
    """Every clean checkpoint has all four assets; every corrupt one is blocked."""
    return bool(outcomes) and all(o.blocked if o.key in corrupt else o.complete for o in outcomes)


def wait_until(condition: Callable[[], bool], timeout_s: float, *, poll_s: float = 1.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def wait_for_daemon(instance: DagsterInstance, timeout_s: float = 120) -> bool:
    """The sensor and automation daemons have sent a heartbeat (the code location loaded)."""
    needed = {"SENSOR", "ASSET"}
    return wait_until(lambda: needed <= set(instance.get_daemon_heartbeats()), timeout_s)


def prepare_instance(dagster_home: str) -> None:
    """Create the instance's storages before any Dagster process starts: on a fresh
    SQLite instance the daemon and its code server would otherwise both create the
    schedule database at once and trip over each other's schema stamp."""
    with DagsterInstance.from_config(dagster_home) as instance:
        instance.get_runs(limit=1)
        instance.all_instigator_state()
        instance.get_daemon_heartbeats()


def lifecycle_env(dagster_home: str, store: str, archive: str, **extra: str) -> dict[str, str]:
    """The environment a daemon of this code location runs in (this checkout's code first)."""
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "DAGSTER_HOME": dagster_home,
        "CKPTFLOW_STORE": store,
        "CKPTFLOW_ARCHIVE": archive,
        "PYTHONPATH": REPO + (os.pathsep + path if path else ""),
        **extra,
    }


def dagster_bin(name: str) -> str:
    """A Dagster command of the interpreter running us (the project's virtual environment)."""
    return os.path.join(os.path.dirname(sys.executable), name)


def start(command: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen:
    """A long-running Dagster process in its own process group (it starts a code server
    and run workers; stopping the group stops them too)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(process: subprocess.Popen, timeout_s: float = 30) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def train_other_model(store: str, env: dict[str, str], *args: str) -> str:
    """Run the regressor training script as its own process; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "pipelines.demo.regressor", "--store", store, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


DEMO_RUN = "regressor-demo"


def demonstrate(store: str, archive: str, dagster_home: str, timeout_s: float = 240) -> bool:
    """``make demo``'s last part: the real daemon on the demo's instance carries three
    checkpoints of another team's model through, the newest corrupted; prints when each
    was validated, evaluated and archived. Whether everything settled as it should."""
    print(
        f"== the real path: dagster-daemon on {dagster_home} (default sensor intervals); another training "
        f"process (pipelines/demo/regressor.py: an MLP regressor reporting its own val_loss) commits 3 checkpoints "
        "of run 'regressor-demo', the newest corrupted"
    )
    env = lifecycle_env(dagster_home, store, archive)
    env.pop("CKPTFLOW_SENSOR_INTERVAL_S", None)
    log = os.path.join(dagster_home, "demo-daemon.log")
    started = time.monotonic()
    process = start([dagster_bin("dagster-daemon"), "run", "-w", "workspace.yaml"], env, log)
    corrupt = {checkpoint_key(DEMO_RUN, 60)}
    try:
        with DagsterInstance.from_config(dagster_home) as instance:
            if not wait_for_daemon(instance):
                print(f"  the daemon did not start; see {log}")
                return False
            print(f"  daemon running after {time.monotonic() - started:.1f} s (it loads the code location)")
            train_other_model(store, env, "--run", DEMO_RUN, "--checkpoints", "3", "--corrupt-newest")
            ok = wait_until(lambda: settled(observe(instance, store, DEMO_RUN), corrupt), timeout_s)
            outcomes = observe(instance, store, DEMO_RUN)
    finally:
        stop(process)
    for o in outcomes:
        if o.blocked:
            print(f"  {o.key}: blocked by its integrity check (validate_checkpoint failed; nothing downstream ran)")
        else:
            after = {k: f"{v:.1f} s" for k, v in o.after_s.items()}
            print(
                f"  {o.key}: after its commit: validated {after.get('checkpoint', '-')}, "
                f"evaluated {after.get('evaluation', '-')} (trainer metrics), archived {after.get('archived', '-')}"
            )
    if not ok:
        print(f"  not everything settled within {timeout_s:.0f} s; see {log} and the runs in the UI")
    return ok
