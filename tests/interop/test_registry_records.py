"""Registry records that are damaged, hand-edited or raced: a model file that rotted is
healed by the next promotion, a refused promotion registers nothing, a broken alias blocks
no repair, rollback reports what it did, version records are checked and read bounded."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import aliases as alias_records
from ckptflow.errors import PromotionError, RegistryError, StoreUnavailableError
from ckptflow.interop.export import model_metadata
from ckptflow.interop.registry import Registry
from ckptflow.lifecycle.promote import PromotionRequest, promote, rebuild, rollback
from ckptflow.store import open_store
from support.corrupt import corrupt_chunk, flip_byte
from support.faulty_store import FaultyStore
from support.registry_models import Tiny, checkpoints

promote_module = importlib.import_module("ckptflow.lifecycle.promote")


def test_a_model_file_that_rotted_is_written_again_by_the_next_promotion_or_rebuild(tmp_path):
    """The object under a file's sha256 no longer hashes to it (same size): a promotion of
    the same weights, or a rebuild, writes the right bytes there again."""
    root, _ = checkpoints(tmp_path, steps=(1,))
    hot = open_store(root)
    reg = Registry(hot)
    v1 = promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable")).registered
    path = tmp_path / "hot" / reg.file_key("m", v1.files["model.safetensors"]["sha256"])
    for heal in (
        lambda: promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable")),
        lambda: rebuild(reg, "m", 1, [hot]),
    ):
        flip_byte(path, -3)
        with pytest.raises(RegistryError, match="does not match its sha256"):
            reg.download(v1, tmp_path / "served")
        heal()
        reg.download(v1, tmp_path / "served")  # checks every file's sha256


def test_a_download_that_finds_one_file_rotted_changes_nothing_in_its_directory(tmp_path):
    """Files were written as they were checked: one that did not match left the directory
    half the new version, half the one served before."""
    root, _ = checkpoints(tmp_path, steps=(1, 2))
    hot = open_store(root)
    reg = Registry(hot)
    v1 = promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable")).registered
    v2 = promote(hot, reg, PromotionRequest("m", ("r", 2), stage="stable")).registered
    served = tmp_path / "served"
    reg.download(v1, served)
    before = {p.name: p.read_bytes() for p in served.iterdir()}
    last = max(v2.files)  # written after the others
    assert len(v2.files) > 1 and v2.files[last]["sha256"] != v1.files[last]["sha256"]
    flip_byte(tmp_path / "hot" / reg.file_key("m", v2.files[last]["sha256"]), -3)
    with pytest.raises(RegistryError, match=f"file {last} does not match its sha256"):
        reg.download(v2, served)
    assert {p.name: p.read_bytes() for p in served.iterdir()} == before


def test_a_refused_promotion_registers_no_version_and_a_broken_alias_blocks_no_repair(tmp_path):
    """An alias record that does not read: promotion is refused before a version number is
    claimed. An alias naming a version that does not exist (edited by hand) blocks no move
    that leaves it alone, and set_alias repairs it."""
    root, _ = checkpoints(tmp_path)
    hot = open_store(root)
    reg = Registry(hot)
    promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable"))
    key = reg._aliases_key("m")
    good = hot.get(key)
    hot.replace(key, b"{not json")
    for stage in ("latest", "stable"):
        with pytest.raises(RegistryError, match="alias record is damaged"):
            promote(hot, reg, PromotionRequest("m", ("r", 2), stage=stage))
    assert [v.version for v in reg.versions("m")] == [1]
    hot.replace(key, good)
    doc = json.loads(good)
    hot.replace(key, json.dumps({**doc, "aliases": {**doc["aliases"], "fallback": 7}}).encode())
    with pytest.raises(RegistryError, match=r"m@stable names v9, which does not read .*set_alias"):
        reg.set_alias("m", "stable", 9)
    assert promote(hot, reg, PromotionRequest("m", ("r", 2), stage="latest")).registered.version == 2
    assert reg.aliases("m") == {"latest": 2, "stable": 1, "fallback": 7}
    assert promote(hot, reg, PromotionRequest("m", ("r", 2), stage="stable")).registered.version == 3
    assert reg.aliases("m") == {"latest": 3, "stable": 3, "fallback": 1}  # the old stable replaced the broken one
    hot.replace(key, json.dumps({**doc, "aliases": {"latest": 7, "stable": 7}}).encode())
    for alias in ("latest", "stable"):
        reg.set_alias("m", alias, 1)
    assert reg.aliases("m") == {"latest": 1, "stable": 1}


def test_rollback_returns_the_version_it_made_stable_not_one_a_later_move_did(tmp_path):
    root, _ = checkpoints(tmp_path)
    hot = open_store(root)

    class PromotedRightAfter(Registry):  # another process makes a new version stable just after the rollback
        def rollback(self, model):
            aliases = super().rollback(model)
            Registry(self.store).register(model, run="r", step=2, manifest_digest="d", files={}, stage="stable")
            return aliases

    reg = PromotedRightAfter(hot)
    for step in (1, 2):
        promote(hot, reg, PromotionRequest("m", ("r", step), stage="stable"))
    assert rollback(reg, "m").version == 1 and reg.aliases("m")["stable"] == 3


def test_a_version_record_of_the_wrong_types_is_refused_and_one_with_new_fields_reads(tmp_path):
    """A version whose step is "1" would pin nothing (retention compares (run, 1, digest)):
    reading it is refused, so a retention plan stops rather than expire what it protects.
    Fields a newer ckptflow added are left out, not a TypeError."""
    root, _ = checkpoints(tmp_path)
    hot = open_store(root)
    reg = Registry(hot)
    v = promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable")).registered
    key = reg.version_key("m", v.version)
    record = json.loads(hot.get(key))
    hot.replace(key, json.dumps({**record, "signed_by": "ci", "attestation": {"k": 1}}).encode())
    assert reg.get("m", v.version) == v and reg.pinned() == {("r", 1, v.manifest_digest)}
    hot.replace(key, json.dumps({**record, "step": "1"}).encode())
    for read in (lambda: reg.get("m", v.version), reg.pinned, lambda: lifecycle.current_plan(hot, None, reg)):
        with pytest.raises(RegistryError, match=r"000001.json is not a version record .* step '1'"):
            read()


def test_a_registry_record_larger_than_any_is_refused_unread(tmp_path, monkeypatch):
    root, _ = checkpoints(tmp_path, steps=(1,))
    hot = open_store(root)
    reg = Registry(hot)
    v = promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable")).registered
    monkeypatch.setattr(alias_records, "MAX_RECORD_BYTES", 16)  # every real record is larger: as if each were huge
    for read in (lambda: reg.get("m", v.version), lambda: reg.aliases("m"), lambda: reg.promote("m", v.version)):
        with pytest.raises(RegistryError, match="larger than any registry record"):
            read()


def test_a_latest_naming_a_missing_newer_version_is_replaced_by_the_next_registration(tmp_path):
    """latest = the newer of what it names and the new version; one naming v99, which
    does not exist (edited by hand), would stay for good and break every retention plan."""
    root, _ = checkpoints(tmp_path)
    hot = open_store(root)
    reg = Registry(hot)
    promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable"))
    doc = json.loads(hot.get(reg._aliases_key("m")))
    hot.replace(reg._aliases_key("m"), json.dumps({**doc, "aliases": {**doc["aliases"], "latest": 99}}).encode())
    assert promote(hot, reg, PromotionRequest("m", ("r", 2), stage="latest")).registered.version == 2
    assert reg.aliases("m")["latest"] == 2 and reg.resolve("m", "latest").step == 2
    lifecycle.current_plan(hot, None, reg)  # reads every alias


@pytest.mark.parametrize("name", ["../../escaped.txt", "/tmp/escaped.txt", "..", "a\\b", ""])
def test_a_version_file_name_that_is_a_path_is_refused_on_register_and_read(tmp_path, name):
    """A version's file names are written at ``directory/name`` by ``download`` (the MLflow
    mirror downloads into a temporary directory): ``../../escaped.txt`` was registered and
    downloaded outside it. Now register refuses it before claiming a number, and a record
    holding one (written by hand, or by an older ckptflow) does not read."""
    reg = Registry(open_store(str(tmp_path / "store")))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_bytes(b"model bytes\n")
    files = reg.upload("m", tmp_path / "src", ["a"])
    with pytest.raises(RegistryError, match="is not a plain file name.*nothing registered"):
        reg.register("m", run="r", step=1, manifest_digest="0" * 64, files={name: files["a"]})
    assert reg.versions("m") == []
    good = reg.register("m", run="r", step=1, manifest_digest="0" * 64, files=files)
    key = reg.version_key("m", good.version)
    record = json.loads(reg.store.get(key))
    reg.store.replace(key, json.dumps({**record, "files": {name: files["a"]}}).encode())
    with pytest.raises(RegistryError, match="is not a version record of this layout: file name"):
        reg.download(reg.get("m", good.version), tmp_path / "dl" / "sub")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "store"]


def test_a_rebuild_through_an_outage_says_the_store_is_unavailable_not_that_the_checkpoint_is_gone(tmp_path):
    """A tier that could not be read proves nothing about what it holds: a rebuild that found
    no source because of an outage says so (retry), not that no tier holds the commit."""
    root, _ = checkpoints(tmp_path, steps=(1,))
    hot = open_store(root)
    reg = Registry(hot)
    v1 = promote(hot, reg, PromotionRequest("m", ("r", 1))).registered
    down = FaultyStore(hot)
    down.fail_if = lambda op, key: key.startswith("runs/")  # every read of a checkpoint fails (an OSError)
    with pytest.raises(StoreUnavailableError, match=rf"could not read r@1 in {hot.url}.*rebuild again once"):
        rebuild(reg, "m", v1.version, [down])
    lifecycle.expire(hot, "r", 1)
    with pytest.raises(RegistryError, match="no tier .* holds r@1") as gone:  # absent: proved, and said so
        rebuild(reg, "m", v1.version, [hot])
    assert not isinstance(gone.value, StoreUnavailableError)


def test_a_rollback_to_a_fallback_whose_files_were_deleted_is_refused_and_moves_nothing(tmp_path):
    """The rollback moved stable to a version no deploy could download; it now says which
    files are gone and to rebuild them first, and the aliases stay as they were."""
    root, _ = checkpoints(tmp_path)
    hot = open_store(root)
    reg = Registry(hot)
    v1 = promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable")).registered
    promote(hot, reg, PromotionRequest("m", ("r", 2), stage="stable"))
    before = reg.aliases("m")
    hot.delete(reg.file_key("m", v1.files["model.safetensors"]["sha256"]))
    with pytest.raises(RegistryError, match=r"fallback v1 .*model\.safetensors.*rebuild.*nothing moved"):
        rollback(reg, "m")
    assert reg.aliases("m") == before
    rebuild(reg, "m", 1, [hot])
    assert rollback(reg, "m").version == 1 and reg.aliases("m") == {"latest": 2, "stable": 1, "fallback": 2}


def test_a_damaged_version_record_blocks_no_later_promotion(tmp_path):
    """Claiming the next number read every version record, so one damaged record (v1
    rotted) refused every promotion of the model for good; retention still refuses to plan
    over it, as it must (the record may pin a checkpoint)."""
    root, _ = checkpoints(tmp_path)
    hot = open_store(root)
    reg = Registry(hot)
    v1 = promote(hot, reg, PromotionRequest("m", ("r", 1), stage="stable")).registered
    hot.replace(reg.version_key("m", v1.version), b"{not json")
    v2 = promote(hot, reg, PromotionRequest("m", ("r", 2), stage="latest")).registered
    assert v2.version == 2 and reg.version_numbers("m") == [1, 2] and reg.aliases("m")["latest"] == 2
    with pytest.raises(RegistryError, match="000001.json"):
        lifecycle.current_plan(hot, None, reg)


def test_a_step_committed_again_while_a_promotion_validates_it_is_refused_as_that(tmp_path, monkeypatch):
    """The promotion validates a damaged step (no verdict yet); the job saves that step again
    meanwhile (its restore skipped it). The verdict is the new commit's: the refusal said "it failed validation ([])"
    of a checkpoint that passed, instead of what happened."""
    root, _ = checkpoints(tmp_path)
    hot = open_store(root)
    corrupt_chunk(root, "r", 2)
    real_validate = promote_module.validate

    def saved_again_meanwhile(store, run, step, **kwargs):
        model = Tiny()
        with Checkpointer(root, "r", chunk_bytes=1 << 20) as ck:  # the job resumes past the damaged step
            assert ck.restore({"model": model}).step == 1
            torch.manual_seed(7)
            ck.save(2, {"model": model}, metadata=model_metadata(model))
        return real_validate(store, run, step, **kwargs)

    monkeypatch.setattr(promote_module, "validate", saved_again_meanwhile)
    with pytest.raises(PromotionError, match="committed again while it was being validated; promote again"):
        promote(hot, Registry(hot), PromotionRequest("m", ("r", 2)))
    assert Registry(hot).version_numbers("m") == []
