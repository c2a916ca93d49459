"""The MLflow mirror of ckptflow's registry, against a real ``mlflow server`` (one per session):
promotion registers the exported files as an MLflow model version with its lineage, the
aliases follow ckptflow's (a rollback moves them), MLflow's own API loads the model back by
alias bit-exact, a second sync changes nothing, and a failed MLflow call is retried or fails
the mirror alone, which the next sync finishes."""

from __future__ import annotations

import hashlib
import os
import uuid

import mlflow
import pytest
import torch
from mlflow import MlflowClient
from torch import nn

from ckptflow import Checkpointer
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.errors import ColdObjectError, MirrorError
from ckptflow.interop.export import load_exported, model_metadata
from ckptflow.interop.mlflow_registry import MlflowMirror
from ckptflow.interop.registry import Registry
from ckptflow.lifecycle.promote import PromotionRequest, promote, rollback
from ckptflow.store import open_store
from support.postgres import free_port

pytestmark = pytest.mark.slow  # a real `mlflow server` per session: make test-e2e


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)


def checkpoints(tmp_path, steps=(1, 2)):
    root = str(tmp_path / "hot")
    models = {}
    with Checkpointer(root, "r", chunk_bytes=1 << 20) as ck:
        for step in steps:
            torch.manual_seed(step)
            models[step] = Tiny()
            metadata = {**model_metadata(models[step]), "val_loss": 1.0 / step, "data": "arith-v1"}
            ck.save(step, {"model": models[step]}, metadata=metadata)
    hot = open_store(root)
    return hot, Registry(hot), models


@pytest.fixture
def mlflow_uri(mlflow_tracking_uri, monkeypatch):
    """The session's server, also as MLflow's default tracking and registry URI: what a team's
    code that loads ``models:/<name>@stable`` uses."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_tracking_uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", mlflow_tracking_uri)
    return mlflow_tracking_uri


def mirror_for(uri: str, **kwargs) -> MlflowMirror:
    """A mirror into MLflow models of their own (the server is shared by the session)."""
    return MlflowMirror(uri, registered_model="{model}-" + uuid.uuid4().hex[:8], wait_s=0.01, **kwargs)


def load_by_alias(name: str, alias: str, dst) -> tuple[dict[str, torch.Tensor], str]:
    path = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}@{alias}", dst_path=dst)
    return load_exported(path), path


def test_promotion_and_rollback_mirror_into_mlflow_and_load_back_by_alias_bit_exact(mlflow_uri, tmp_path):
    hot, reg, models = checkpoints(tmp_path)
    mirror = mirror_for(mlflow_uri, partition_link="http://dagster/assets/checkpoint?partition={partition_key}")
    name = mirror.name_of("m")
    v1 = promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable"), mirror=mirror).registered
    v2 = promote(hot, reg, PromotionRequest("m", ("r", 2), stage="stable"), mirror=mirror).registered
    client = MlflowClient()
    assert client.get_registered_model(name).aliases == {"newest": "2", "stable": "2", "fallback": "1"}

    tensors, path = load_by_alias(name, "stable", str(tmp_path / "stable"))
    for file, recorded in v2.files.items():  # the very bytes ckptflow registered
        assert hashlib.sha256(open(os.path.join(path, file), "rb").read()).hexdigest() == recorded["sha256"]
    for key, value in models[2].state_dict().items():
        assert torch.equal(tensors[key], value), key
    tensors, _ = load_by_alias(name, "fallback", str(tmp_path / "fallback"))
    assert torch.equal(tensors["head.weight"], models[1].head.weight)

    tags = client.get_model_version(name, "2").tags
    assert tags["ckptflow.version"] == "2" and tags["ckptflow.run"] == "r" and tags["ckptflow.step"] == "2"
    assert tags["ckptflow.manifest_digest"] == read_manifest(hot, "r", 2).digest == v2.manifest_digest
    assert tags["ckptflow.partition_key"] == v2.partition_key
    assert tags["ckptflow.partition_link"] == f"http://dagster/assets/checkpoint?partition={v2.partition_key}"
    assert tags["ckptflow.validation"] == "passed"
    assert float(tags["ckptflow.metric.val_loss"]) == 0.5
    assert tags["ckptflow.data"] == '"arith-v1"'
    assert tags["ckptflow.registry"] == hot.url
    run = client.get_run(client.get_model_version(name, "2").run_id)
    assert run.data.metrics["val_loss"] == 0.5

    assert rollback(reg, "m", mirror=mirror).version == v1.version  # a rollback moves MLflow's aliases too
    assert client.get_registered_model(name).aliases == {"newest": "2", "stable": "1", "fallback": "2"}
    tensors, _ = load_by_alias(name, "stable", str(tmp_path / "rolled-back"))
    assert torch.equal(tensors["embed.weight"], models[1].embed.weight)


def test_a_second_sync_changes_nothing(mlflow_uri, tmp_path):
    hot, reg, _ = checkpoints(tmp_path)
    mirror = mirror_for(mlflow_uri)
    promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable"), mirror=mirror)
    promote(hot, reg, PromotionRequest("m", ("r", 2)), mirror=mirror)
    client = MlflowClient()
    name = mirror.name_of("m")
    before = [(v.version, v.last_updated_timestamp) for v in client.search_model_versions(f"name = '{name}'")]
    again = mirror.sync(reg, "m")
    assert not again.changed and again.versions == {1: "1", 2: "2"}
    assert again.aliases == {"newest": "2", "stable": "1"}
    after = [(v.version, v.last_updated_timestamp) for v in client.search_model_versions(f"name = '{name}'")]
    assert sorted(after) == sorted(before)
    experiment = client.get_experiment_by_name(mirror.experiment).experiment_id
    runs = client.search_runs([experiment], filter_string=f"tags.`ckptflow.registered_model` = '{name}'")
    assert sorted(r.data.tags["ckptflow.version"] for r in runs) == ["1", "2"]


def test_a_failed_call_is_retried(mlflow_uri, tmp_path):
    hot, reg, _ = checkpoints(tmp_path, steps=(1,))
    mirror = mirror_for(mlflow_uri, attempts=3)
    real, calls = mirror.client.create_model_version, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("connection reset by peer (injected)")
        return real(*args, **kwargs)

    mirror.client.create_model_version = flaky
    promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable"), mirror=mirror)
    assert len(calls) == 2
    name = mirror.name_of("m")
    assert [v.version for v in MlflowClient().search_model_versions(f"name = '{name}'")] == ["1"]


def test_a_mirror_that_fails_leaves_ckptflow_promoted_and_the_next_sync_finishes(mlflow_uri, tmp_path):
    hot, reg, models = checkpoints(tmp_path, steps=(1,))
    mirror = mirror_for(mlflow_uri, attempts=2)
    real = mirror.client.create_model_version

    def down(*args, **kwargs):
        raise ConnectionError("MLflow is down (injected)")

    mirror.client.create_model_version = down  # the run and its files are logged, the version is not made
    with pytest.raises(MirrorError, match="after 2 attempts.*source of truth: sync again"):
        promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable"), mirror=mirror)
    assert reg.aliases("m") == {"latest": 1, "stable": 1}  # ckptflow's promotion stands
    mirror.client.create_model_version = real
    done = mirror.sync(reg, "m")
    assert done.created == [1] and done.aliases == {"newest": "1", "stable": "1"}
    client = MlflowClient()
    experiment = client.get_experiment_by_name(mirror.experiment).experiment_id
    name = mirror.name_of("m")
    runs = client.search_runs([experiment], filter_string=f"tags.`ckptflow.registered_model` = '{name}'")
    assert [r.info.run_id for r in runs] == [client.get_model_version(name, "1").run_id]  # the first run, reused
    tensors, _ = load_by_alias(name, "stable", str(tmp_path / "out"))
    assert torch.equal(tensors["head.weight"], models[1].head.weight)


def test_an_unreachable_mlflow_fails_the_mirror_only(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    hot, reg, _ = checkpoints(tmp_path, steps=(1,))
    mirror = MlflowMirror(f"http://127.0.0.1:{free_port()}", attempts=2, wait_s=0.01)
    with pytest.raises(
        MirrorError, match=r"could not create registered model 'm' in MLflow at http://127\.0\.0\.1"
    ) as err:
        promote(hot, reg, PromotionRequest("m", ("r", 1)), mirror=mirror)
    assert err.value.retry  # MLflow did not answer: syncing again later may finish it
    assert [v.version for v in reg.versions("m")] == [1] and reg.aliases("m") == {"latest": 1}


def test_another_registry_mirroring_into_the_same_mlflow_model_is_refused(mlflow_uri, tmp_path):
    hot, reg, _ = checkpoints(tmp_path / "a", steps=(1,))
    mirror = mirror_for(mlflow_uri)
    promote(hot, reg, PromotionRequest("m", ("r", 1)), mirror=mirror)
    other_hot, other_reg, _ = checkpoints(tmp_path / "b", steps=(2,))
    promote(other_hot, other_reg, PromotionRequest("m", ("r", 2)))
    with pytest.raises(MirrorError, match="another ckptflow registry mirrors into this MLflow model") as err:
        mirror.sync(other_reg, "m")
    assert not err.value.retry  # a clash that every sync repeats until the mirror is renamed


def test_a_run_left_by_another_registrys_failed_sync_is_not_reused_for_other_bytes(mlflow_uri, tmp_path):
    """Registry a's sync logged its v1's files and failed before the model version was made;
    registry b then syncs its own v1 into the same MLflow model. The run was found by model
    and version number alone, so b's version was registered on a's files (tagged with b's
    manifest digest): a model loaded by alias held other weights than its lineage said."""
    hot, reg, _ = checkpoints(tmp_path / "a", steps=(1,))
    mirror = mirror_for(mlflow_uri, attempts=1)
    real = mirror.client.create_model_version
    mirror.client.create_model_version = lambda *args, **kwargs: (_ for _ in ()).throw(ConnectionError("down"))
    with pytest.raises(MirrorError):
        promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable"), mirror=mirror)
    mirror.client.create_model_version = real
    other_hot, other_reg, other_models = checkpoints(tmp_path / "b", steps=(2,))
    v1 = promote(other_hot, other_reg, PromotionRequest("m", ("r", 2), stage="stable"), mirror=mirror).registered
    name = mirror.name_of("m")
    mirrored = MlflowClient().get_model_version(name, "1")
    assert mirrored.tags["ckptflow.manifest_digest"] == v1.manifest_digest
    tensors, _ = load_by_alias(name, "stable", str(tmp_path / "out"))
    assert torch.equal(tensors["head.weight"], other_models[2].head.weight)  # b's bytes, as its tags say
    with pytest.raises(MirrorError, match="another ckptflow registry mirrors into this MLflow model"):
        mirror.sync(reg, "m")


def test_a_rotted_registry_file_fails_the_sync_once_naming_ckptflows_registry_not_mlflow(mlflow_uri, tmp_path):
    """A file of the version to mirror no longer hashes to its record: a ckptflow registry
    problem that retrying MLflow calls cannot fix. It was retried as an MLflow failure and
    reported as one ("could not ... in MLflow ... sync again")."""
    hot, reg, _ = checkpoints(tmp_path, steps=(1,))
    v1 = promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable")).registered
    path = tmp_path / "hot" / reg.file_key("m", v1.files["model.safetensors"]["sha256"])
    path.write_bytes(bytes(path.stat().st_size))
    mirror = mirror_for(mlflow_uri, attempts=3)
    downloads = []
    real = reg.download
    reg.download = lambda *args: (downloads.append(1), real(*args))[1]
    with pytest.raises(MirrorError) as err:
        mirror.sync(reg, "m")
    message = str(err.value)
    assert "does not match its sha256" in message and "rebuild" in message and "in MLflow at" not in message
    assert not err.value.retry  # damage, which waiting does not mend
    assert len(downloads) == 1


def test_a_cold_registry_file_fails_the_sync_once_saying_to_thaw_it_and_not_to_retry(mlflow_uri, tmp_path):
    """A registry file in Glacier raised ``ColdObjectError``, a ``StoreUnavailableError``, so
    the mirror said ``retry`` and the step's policy retried it minutes apart, each reading the
    same cold object: a thaw takes hours and must be requested."""
    hot, reg, _ = checkpoints(tmp_path, steps=(1,))
    v1 = promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable")).registered
    thaw = f"ckptflow thaw {hot.url} --run r --step 1"
    downloads = []

    def cold(*args):
        downloads.append(1)
        key = reg.file_key("m", v1.files["model.safetensors"]["sha256"])
        raise ColdObjectError(f"{key} is in GLACIER and must be restored first: run `{thaw}`")

    reg.download = cold
    with pytest.raises(MirrorError) as err:
        mirror_for(mlflow_uri, attempts=3).sync(reg, "m")
    assert thaw in str(err.value) and "ckptflow's registry failed, not MLflow" in str(err.value)
    assert not err.value.retry  # waiting minutes does not thaw it
    assert len(downloads) == 1 and reg.aliases("m") == {"latest": v1.version, "stable": v1.version}
