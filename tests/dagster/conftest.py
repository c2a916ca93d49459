"""Fixtures for the Dagster layer: a store of real TinyLM checkpoints, resources, defs."""

import fcntl
import json
import os
import shutil

import pytest

from support.dagster import EVALUATORS, write_checkpoints


@pytest.fixture
def paths(tmp_path):
    return {"store": str(tmp_path / "store"), "archive": str(tmp_path / "archive")}


@pytest.fixture(scope="session")
def trained_store(tmp_path_factory):
    """The demo TinyLM trained and saved at steps 10-40 once per test session: training
    takes seconds, a copy of its 4 MiB store milliseconds. Under xdist the workers share
    one (the first to get the lock trains it, the others wait for it)."""
    session_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        session_dir = session_dir.parent  # the run's directory, above each worker's own
    root = session_dir / "trained-store"
    with open(session_dir / "trained-store.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not root.exists():
            partial = session_dir / f"trained-store.{os.getpid()}"
            write_checkpoints(str(partial))
            partial.rename(root)
    return str(root)


@pytest.fixture
def store_with_checkpoints(paths, trained_store):
    """This test's own copy of ``trained_store`` (tests damage it, save into it, gc it);
    modification times are kept, so commits land in the order training saved them."""
    shutil.copytree(trained_store, paths["store"])
    return paths["store"]


@pytest.fixture
def resources(paths):
    from resources import (
        ArchiveResource,
        CheckpointStoreResource,
        EvaluatorResource,
        PricingResource,
        RegistryResource,
        RetentionResource,
    )

    return {
        "store": CheckpointStoreResource(url=paths["store"]),
        "archive": ArchiveResource(url=paths["archive"]),
        "registry": RegistryResource(url=paths["store"]),
        "evaluator": EvaluatorResource(evaluators=EVALUATORS),
        "pricing": PricingResource(),
        "retention": RetentionResource(),
    }


@pytest.fixture
def defs(paths, monkeypatch):
    monkeypatch.setenv("CKPTFLOW_STORE", paths["store"])
    monkeypatch.setenv("CKPTFLOW_ARCHIVE", paths["archive"])
    monkeypatch.setenv("CKPTFLOW_EVALUATORS", json.dumps(EVALUATORS))
    from pipelines.definitions import build_definitions

    return build_definitions("local")


@pytest.fixture
def defs_with_retention(defs, monkeypatch, tmp_path):
    """Definitions whose retention policy is ``policy`` (the file ``CKPTFLOW_RETENTION`` names)."""
    from pipelines.definitions import build_definitions

    def build(**policy):
        path = tmp_path / "retention.json"
        path.write_text(json.dumps(policy))
        monkeypatch.setenv("CKPTFLOW_RETENTION", str(path))
        return build_definitions("local")

    return build


@pytest.fixture
def instance():
    from dagster import DagsterInstance

    with DagsterInstance.ephemeral() as inst:
        yield inst
