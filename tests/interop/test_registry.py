"""Model registry: the store's compare-and-swap, create-only versions with content-addressed
files, alias moves that never lose a concurrent move, promotion races, streamed uploads,
and rebuilding a deleted export from its checkpoint (hot or archive) to the same bytes."""

from __future__ import annotations

import hashlib
import json
import threading
import tracemalloc

import pytest
import torch
from safetensors import safe_open

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.errors import ObjectNotFoundError, RegistryError
from ckptflow.interop.export import load_exported
from ckptflow.interop.registry import Registry, describe
from ckptflow.lifecycle.promote import PromotionRequest, promote, rebuild, rollback
from ckptflow.store import LocalStore, open_store
from support.registry_models import Tiny, checkpoints


# ---- the store capability ------------------------------------------------------------------
def test_replace_if_is_compare_and_swap(store_url):
    store = open_store(store_url)
    assert store.compare_and_swap
    with pytest.raises(ObjectNotFoundError):
        store.get_versioned("reg/a.json")
    assert store.replace_if("reg/a.json", b"one", None)
    assert not store.replace_if("reg/a.json", b"two", None)  # create-only when expecting nothing
    data, version = store.get_versioned("reg/a.json")
    assert data == b"one"
    assert not store.replace_if("reg/a.json", b"two", version + "x")
    assert store.replace_if("reg/a.json", b"two", version)
    assert not store.replace_if("reg/a.json", b"three", version)  # stale: someone (we) moved it
    assert store.get("reg/a.json") == b"two"
    assert [i.key for i in store.list("reg/")] == ["reg/a.json"]  # no lock or temp files listed


def test_local_compare_and_swap_loses_no_update_under_contention(tmp_path):
    store = LocalStore(str(tmp_path / "s"))
    store.replace_if("counter", b"0", None)
    barrier = threading.Barrier(6)

    def add(times: int) -> None:
        barrier.wait()
        for _ in range(times):
            while True:
                data, version = store.get_versioned("counter")
                if store.replace_if("counter", str(int(data) + 1).encode(), version):
                    break

    threads = [threading.Thread(target=add, args=(40,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get("counter") == b"240"


# ---- versions and aliases -----------------------------------------------------------------
def files_of(reg: Registry, tmp_path, content: bytes) -> dict:
    d = tmp_path / hashlib.sha256(content).hexdigest()[:8]
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes(content)
    return reg.upload("tinylm", d, ["model.safetensors"])


def register(reg: Registry, tmp_path, step: int, stage: str | None = "latest"):
    files = files_of(reg, tmp_path, f"weights of step {step}".encode())
    return reg.register(
        "tinylm",
        run="run-a",
        step=step,
        manifest_digest=f"d{step}",
        files=files,
        lineage={"data": "arith"},
        stage=stage,
    )


def test_versions_aliases_promote_and_rollback(store_url, tmp_path):
    reg = Registry(open_store(store_url))
    v1, v2 = register(reg, tmp_path, 10), register(reg, tmp_path, 20)
    assert (v1.version, v2.version) == (1, 2) and reg.aliases("tinylm") == {"latest": 2}
    got = reg.get("tinylm", 2)
    assert got.partition_key == "run-a@20" and got.lineage == {"data": "arith"}
    assert reg.store.get(reg.file_key("tinylm", got.files["model.safetensors"]["sha256"])) == b"weights of step 20"
    assert describe(got)["files"] == "model.safetensors"
    assert not reg.store.put_if_absent(reg.version_key("tinylm", 1), b"{}")  # a version never changes
    register(reg, tmp_path, 30, stage=None)
    assert reg.aliases("tinylm") == {"latest": 2}
    assert reg.promote("tinylm", 1) == {"latest": 2, "stable": 1}
    assert reg.promote("tinylm", 2) == {"latest": 2, "stable": 2, "fallback": 1}
    assert reg.promote("tinylm", 2) == {"latest": 2, "stable": 2, "fallback": 1}  # idempotent
    assert register(reg, tmp_path, 40, stage="stable").version == 4
    assert reg.aliases("tinylm") == {"latest": 4, "stable": 4, "fallback": 2}
    assert reg.rollback("tinylm") == {"latest": 4, "stable": 2, "fallback": 4}
    assert reg.resolve("tinylm", "stable").step == 20
    assert reg.rollback("tinylm")["stable"] == 4  # a second rollback undoes the first
    digest = {v.step: v.manifest_digest for v in reg.versions("tinylm")}
    assert reg.pinned() == {("run-a", s, digest[s]) for s in (10, 20, 30, 40)}
    assert reg.aliased() == {
        ("run-a", 40, digest[40]): ["tinylm:latest", "tinylm:stable"],
        ("run-a", 20, digest[20]): ["tinylm:fallback"],
    }


def test_bad_moves_raise_and_change_nothing(tmp_path):
    reg = Registry(open_store(str(tmp_path / "store")))
    register(reg, tmp_path, 10)
    before = reg.store.get(reg._aliases_key("tinylm"))
    with pytest.raises(RegistryError, match="no fallback"):
        reg.rollback("tinylm")
    with pytest.raises(RegistryError, match="not one of"):
        reg.set_alias("tinylm", "prod", 1)
    with pytest.raises(RegistryError, match="no version 7"):
        reg.promote("tinylm", 7)
    with pytest.raises(RegistryError, match="no alias"):
        reg.resolve("tinylm", "stable")
    assert reg.store.get(reg._aliases_key("tinylm")) == before


def test_a_move_between_read_and_write_is_not_lost(tmp_path):
    """Another writer moves ``stable`` after this move read the aliases: the swap fails,
    the move is recomputed from the new aliases, and both moves survive (a
    read-modify-write would silently drop the other's)."""
    store = open_store(str(tmp_path / "store"))
    reg, other = Registry(store), Registry(store)
    for step in (10, 20, 30):
        register(reg, tmp_path, step, stage=None)
    calls = []

    def set_latest(aliases):
        calls.append(dict(aliases))
        if len(calls) == 1:
            other.promote("tinylm", 2)  # lands between our read and our write
        return {**aliases, "latest": 3}

    assert reg.move("tinylm", "test", set_latest) == {"latest": 3, "stable": 2}
    assert calls == [{}, {"stable": 2}] and reg.aliases("tinylm") == {"latest": 3, "stable": 2}


def test_a_move_whose_response_was_lost_is_not_applied_twice(tmp_path):
    class LostResponse(LocalStore):
        lost = 0

        def replace_if(self, key, data, expected):
            wrote = super().replace_if(key, data, expected)
            if wrote and key.endswith("aliases.json") and self.lost == 0:
                self.lost += 1
                return False  # the write landed; the caller never heard
            return wrote

    reg = Registry(LostResponse(str(tmp_path / "store")))
    for step in (10, 20):
        register(reg, tmp_path, step, stage=None)
    reg.store.lost = 1
    reg.promote("tinylm", 1)
    reg.promote("tinylm", 2)
    reg.store.lost = 0
    assert reg.rollback("tinylm") == {"stable": 1, "fallback": 2}  # once, not undone by a retry
    assert reg.aliases("tinylm") == {"stable": 1, "fallback": 2}


def test_racing_registrations_leave_a_consistent_registry(tmp_path):
    store = open_store(str(tmp_path / "store"))
    barrier = threading.Barrier(8)
    errors = []

    def one(step: int) -> None:
        reg = Registry(store)
        files = files_of(reg, tmp_path, f"weights of step {step}".encode())
        barrier.wait()
        try:
            reg.register("tinylm", run="run-a", step=step, manifest_digest=f"d{step}", files=files, stage="stable")
        except Exception as e:  # collected for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(s,)) for s in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    reg = Registry(store)
    versions = reg.versions("tinylm")
    assert [v.version for v in versions] == list(range(1, 9))
    for v in versions:  # every version serves exactly the bytes of its own checkpoint
        blob = reg.store.get(reg.file_key("tinylm", v.files["model.safetensors"]["sha256"]))
        assert blob == f"weights of step {v.step}".encode()
    aliases = reg.aliases("tinylm")
    assert aliases["latest"] == 8 and aliases["stable"] != aliases["fallback"]
    assert {aliases["stable"], aliases["fallback"]} <= set(range(1, 9))


# ---- promotion through the export --------------------------------------------------------
def test_two_promotions_racing_on_one_model_stay_consistent(tmp_path):
    root, models = checkpoints(tmp_path)
    hot = open_store(root)
    barrier = threading.Barrier(2)
    errors = []

    def run(step: int) -> None:
        barrier.wait()
        try:
            promote(hot, Registry(hot), PromotionRequest("m", ("r", step), stage="stable"))
        except Exception as e:  # collected for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    reg = Registry(hot)
    assert [v.version for v in reg.versions("m")] == [1, 2]
    for v in reg.versions("m"):
        out = tmp_path / f"v{v.version}"
        reg.download(v, out)
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert f.metadata()["ckptflow.manifest_digest"] == v.manifest_digest
        assert v.manifest_digest == read_manifest(hot, "r", v.step).digest
        assert torch.equal(load_exported(out)["embed.weight"], models[v.step].embed.weight)
    aliases = reg.aliases("m")
    assert aliases["latest"] == 2 and {aliases["stable"], aliases["fallback"]} == {1, 2}


def test_promotion_uploads_streamed_not_read_whole(tmp_path):
    """A 16 MiB weight file (read from 1 MiB chunks by a few threads, each verifying through a
    1 MiB scratch piece): Python holds at most three quarters of it at once (reading it whole
    would hold all of it)."""
    root, _ = checkpoints(tmp_path, steps=(1,), width=131072)
    hot = open_store(root)
    tracemalloc.start()
    try:
        version = promote(hot, Registry(hot), PromotionRequest("m", ("r", 1))).registered
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert version.files["model.safetensors"]["size"] > 16 << 20
    assert peak < 12 << 20, f"Python allocations peaked at {peak} bytes"


def test_rebuild_a_deleted_export_from_hot_then_archive(tmp_path):
    root, _ = checkpoints(tmp_path)
    hot, archive = open_store(root), open_store(str(tmp_path / "archive"))
    reg = Registry(hot)
    v = promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable")).registered
    assert set(v.files) == {"model.safetensors", "README.md"}
    recorded = {n: f["sha256"] for n, f in v.files.items()}
    for f in v.files.values():
        hot.delete(reg.file_key("m", f["sha256"]))
    assert reg.missing_files(v) == ["README.md", "model.safetensors"]
    assert rebuild(reg, "m", 1, [hot, archive]) == ["README.md", "model.safetensors"]
    assert reg.missing_files(v) == []
    # the hot copy expires after archival: the archive rebuilds the same bytes
    assert lifecycle.archive(hot, archive, "r", 1).ok
    lifecycle.expire(hot, "r", 1, keep_records=True)
    hot.delete(reg.file_key("m", recorded["model.safetensors"]))
    assert rebuild(reg, "m", 1, [hot, archive]) == ["model.safetensors"]
    out = tmp_path / "served"
    reg.download(rollback_safe(reg), out)
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == recorded["model.safetensors"]


def rollback_safe(reg: Registry):
    """The stable version (no fallback yet, so a rollback is refused and changes nothing)."""
    with pytest.raises(RegistryError, match="no fallback"):
        rollback(reg, "m")
    return reg.resolve("m", "stable")


def test_rebuild_refuses_when_the_checkpoint_was_committed_again(tmp_path):
    root, _ = checkpoints(tmp_path, steps=(1,))
    hot = open_store(root)
    reg = Registry(hot)
    v = promote(hot, reg, PromotionRequest("m", ("r", 1))).registered
    for f in v.files.values():
        hot.delete(reg.file_key("m", f["sha256"]))
    lifecycle.expire(hot, "r", 1)
    with Checkpointer(root, "r") as ck:  # step 1 again, other weights: another commit
        torch.manual_seed(99)
        ck.save(1, {"model": Tiny()})
    with pytest.raises(RegistryError, match="manifest digest"):
        rebuild(reg, "m", 1, [hot])
    assert reg.missing_files(v) == sorted(v.files)  # nothing uploaded


def test_version_records_are_json_with_export_options(tmp_path):
    root, _ = checkpoints(tmp_path, steps=(1,))
    hot = open_store(root)
    v = promote(hot, Registry(hot), PromotionRequest("m", ("r", 1), dtype="bf16")).registered
    record = json.loads(hot.get(Registry(hot).version_key("m", 1)))
    assert record["export"]["dtype"] == "bf16" and v.dtype == "bf16"
    assert record["lineage"]["manifest_digest"] == v.manifest_digest
    assert record["lineage"]["validation"]["ok"] is True
