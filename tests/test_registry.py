"""Model registry: create-only versions with lineage, alias moves, promotion, rollback."""

import json

import pytest

from ckptflow.registry import Registry, RegistryError, describe
from ckptflow.store import open_store


def reg(tmp_path):
    return Registry(open_store(str(tmp_path / "store")))


def register(r, step, **kw):
    return r.register(
        "tinylm",
        run="run-a",
        step=step,
        manifest_digest=f"d{step}",
        training_config={"lr": 3e-3},
        data={"name": "arith"},
        **kw,
    )


def test_register_versions_create_only_with_lineage_and_latest(tmp_path):
    r = reg(tmp_path)
    v1 = register(r, 10, artifact={"path": "/tmp/x.safetensors"})
    v2 = register(r, 20, artifact_bytes=b"weights")
    assert (v1.version, v2.version) == (1, 2)
    assert r.aliases("tinylm") == {"latest": 2}
    got = r.get("tinylm", 2)
    assert got.partition_key == "run-a__step-000000000020" and got.manifest_digest == "d20"
    assert got.training_config == {"lr": 3e-3} and got.data == {"name": "arith"}
    assert r.store.get(got.artifact["store_key"]) == b"weights"
    assert describe(got)["artifact"] == got.artifact["store_key"]
    assert r.models() == ["tinylm"] and [v.version for v in r.versions("tinylm")] == [1, 2]
    # a version record is never overwritten: the create-only put refuses
    assert not r.store.put_if_absent(r.version_key("tinylm", 1), b"{}")


def test_racing_register_takes_the_next_number(tmp_path):
    r = reg(tmp_path)
    register(r, 10)
    other = {**r.get("tinylm", 1).to_json(), "version": 2, "step": 99}
    r.store.put_if_absent(r.version_key("tinylm", 2), json.dumps(other).encode())
    # version 2 is taken behind the registry's back (its listing raced): register skips to 3
    r.versions = lambda model: [r.get(model, 1)]  # simulate the stale listing
    assert register(r, 20).version == 3


def test_promote_moves_old_stable_to_fallback_and_rollback_swaps(tmp_path):
    r = reg(tmp_path)
    for step in (10, 20, 30):
        register(r, step)
    assert r.promote("tinylm", 1) == {"latest": 3, "stable": 1}
    assert r.promote("tinylm", 2) == {"latest": 3, "stable": 2, "fallback": 1}
    assert r.promote("tinylm", 2) == {"latest": 3, "stable": 2, "fallback": 1}  # idempotent
    assert r.resolve("tinylm", "stable").step == 20
    assert r.rollback("tinylm") == {"latest": 3, "stable": 1, "fallback": 2}
    assert r.resolve("tinylm", "stable").step == 10
    assert r.rollback("tinylm")["stable"] == 2  # a second rollback undoes the first


def test_rollback_without_fallback_and_bad_aliases_raise(tmp_path):
    r = reg(tmp_path)
    register(r, 10)
    with pytest.raises(RegistryError, match="no fallback"):
        r.rollback("tinylm")
    with pytest.raises(RegistryError, match="not one of"):
        r.set_alias("tinylm", "prod", 1)
    with pytest.raises(RegistryError, match="no version 7"):
        r.promote("tinylm", 7)
    with pytest.raises(RegistryError, match="no alias"):
        r.resolve("tinylm", "stable")


def test_pinned_and_aliased_feed_retention(tmp_path):
    r = reg(tmp_path)
    for step in (10, 20, 30):
        register(r, step)
    r.promote("tinylm", 1)
    r.promote("tinylm", 2)
    assert r.pinned() == {("run-a", 10), ("run-a", 20), ("run-a", 30)}
    assert r.aliased() == {
        ("run-a", 30): ["tinylm:latest"],
        ("run-a", 20): ["tinylm:stable"],
        ("run-a", 10): ["tinylm:fallback"],
    }
