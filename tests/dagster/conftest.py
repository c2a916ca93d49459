"""Fixtures for the Dagster layer: a store of real TinyLM checkpoints, resources, defs."""

import json

import pytest

from support.dagster import EVALUATORS, write_checkpoints


@pytest.fixture
def paths(tmp_path):
    return {"store": str(tmp_path / "store"), "archive": str(tmp_path / "archive")}


@pytest.fixture
def store_with_checkpoints(paths):
    write_checkpoints(paths["store"])
    return paths["store"]


@pytest.fixture
def resources(paths):
    from resources import ArchiveResource, CheckpointStoreResource, EvaluatorResource, RegistryResource

    return {
        "store": CheckpointStoreResource(url=paths["store"]),
        "archive": ArchiveResource(url=paths["archive"]),
        "registry": RegistryResource(url=paths["store"]),
        "evaluator": EvaluatorResource(evaluators=EVALUATORS),
    }


@pytest.fixture
def defs(paths, monkeypatch):
    monkeypatch.setenv("CKPTFLOW_STORE", paths["store"])
    monkeypatch.setenv("CKPTFLOW_ARCHIVE", paths["archive"])
    monkeypatch.setenv("CKPTFLOW_EVALUATORS", json.dumps(EVALUATORS))
    from pipelines.definitions import build_definitions

    return build_definitions("local")


@pytest.fixture
def instance():
    from dagster import DagsterInstance

    with DagsterInstance.ephemeral() as inst:
        yield inst
