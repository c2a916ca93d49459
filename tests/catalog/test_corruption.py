"""Every kind of damage to a checkpoint is reported by ``verify`` and skipped by ``restore``,
which then restores the older good checkpoint and says why it skipped the newer one."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from ckptflow import Checkpointer, CkptflowError, ManifestError, NoValidCheckpointError
from ckptflow.catalog import checkpoints as catalog
from ckptflow.format import layout as fmt
from ckptflow.format.sealed import seal
from ckptflow.interop.export import export_safetensors
from ckptflow.store import open_store
from support.corrupt import grow_first_tensor, reseal_manifest

RUN = "corrupt-run"
GOOD, BAD = 10, 20


def _path(root: str, key: str) -> str:
    return os.path.join(root, *key.split("/"))


def _model_snapshot(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state["model"].state_dict().items()}


def _assert_model_equals(state: dict, snap: dict) -> None:
    sd = state["model"].state_dict()
    for k, v in snap.items():
        assert torch.equal(sd[k], v), f"{k} differs"


class Scenario:
    """A store with a good checkpoint at GOOD and a newer one at BAD with other weights."""

    def __init__(self, root, state_factory, train_step):
        self.root = root
        self.store = open_store(root)
        self.state_factory, self.train_step = state_factory, train_step
        self.state = self.new_state(seed=0)
        self.ck = Checkpointer(root, run=RUN, chunk_bytes=256)
        train_step(self.state, 2)
        self.ck.save(GOOD, self.state, metadata={"which": "good"})
        self.good = _model_snapshot(self.state)
        self.good_extra = self.state["extra"]
        train_step(self.state, 2)  # every weight moves: BAD gets chunks of its own
        self.ck.save(BAD, self.state, metadata={"which": "bad"})
        self.bad = _model_snapshot(self.state)
        m_good = catalog.read_manifest(self.store, RUN, GOOD)
        m_bad = catalog.read_manifest(self.store, RUN, BAD)
        self.only_bad = sorted(set(m_bad.chunks) - set(m_good.chunks))
        self.shared = sorted(set(m_bad.chunks) & set(m_good.chunks))
        assert self.only_bad, "the newest checkpoint must have chunks of its own"
        self.victim = self.only_bad[0]
        self.victim_path = _path(root, fmt.chunk_key(self.victim))
        self.manifest_path = _path(root, fmt.manifest_key(RUN, BAD))
        self.rank_key = m_bad.rank_key(0)
        self.rank_path = _path(root, self.rank_key)

    def new_state(self, seed):
        state = self.state_factory(seed=seed)
        state["frozen"] = torch.arange(256, dtype=torch.float32) + seed  # never trained
        return state

    def restore_fresh(self, **kwargs):
        """Restore into a brand-new state with a brand-new Checkpointer (a restarted job)."""
        fresh = self.new_state(seed=99)
        with Checkpointer(self.root, run=RUN) as ck:
            return fresh, ck.restore(fresh, **kwargs)

    def verify(self, step=BAD):
        with Checkpointer(self.root, run=RUN) as ck:
            return ck.verify(step)


@pytest.fixture
def scenario(ckpt_store_dir, tiny_state_factory, tiny_train_step):
    sc = Scenario(ckpt_store_dir, tiny_state_factory, tiny_train_step)
    yield sc
    sc.ck.close()


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def _assert_skipped_and_fell_back(sc: Scenario, *reason_parts: str) -> str:
    # a good verify of the older checkpoint, so the fallback target is really intact
    assert sc.verify(GOOD).ok
    fresh, result = sc.restore_fresh()
    assert result.step == GOOD
    assert result.metadata == {"which": "good"}
    assert [s for s, _ in result.skipped] == [BAD]
    reason = result.skipped[0][1]
    for part in reason_parts:
        assert part in reason, f"{part!r} not in skip reason {reason!r}"
    _assert_model_equals(fresh, sc.good)
    assert fresh["extra"] == sc.good_extra
    assert torch.equal(fresh["frozen"], torch.arange(256, dtype=torch.float32))
    # restore(step=BAD) never falls back
    with pytest.raises(NoValidCheckpointError) as err:
        sc.restore_fresh(step=BAD)
    assert [s for s, _ in err.value.skipped] == [BAD]
    return reason


def _assert_verify_fails(sc: Scenario, *problem_parts: str) -> list[str]:
    report = sc.verify(BAD)
    assert report.ok is False
    assert report.problems
    text = "\n".join(report.problems)
    for part in problem_parts:
        assert part in text, f"{part!r} not in verify problems {report.problems!r}"
    return report.problems


def test_intact_scenario_verifies_and_restores_newest(scenario):
    report = scenario.verify(BAD)
    assert report.ok and report.problems == [] and report.chunks_checked > 0
    fresh, result = scenario.restore_fresh()
    assert result.step == BAD and result.skipped == []
    _assert_model_equals(fresh, scenario.bad)


# ---- chunk damage -------------------------------------------------------------------------


def test_flipped_byte_in_chunk(scenario):
    size = os.path.getsize(scenario.victim_path)
    _flip_byte(scenario.victim_path, size - 3)  # in the payload, past the header
    problems = _assert_verify_fails(scenario, scenario.victim)
    assert len(problems) == 1
    assert "does not match its address" in problems[0]
    _assert_skipped_and_fell_back(scenario, scenario.victim)


def test_flipped_byte_in_chunk_header(scenario):
    _flip_byte(scenario.victim_path, 0)  # the magic
    _assert_verify_fails(scenario, scenario.victim)
    _assert_skipped_and_fell_back(scenario, scenario.victim)


def test_truncated_chunk(scenario):
    size = os.path.getsize(scenario.victim_path)
    with open(scenario.victim_path, "r+b") as f:
        f.truncate(size // 2)
    _assert_verify_fails(scenario, scenario.victim)
    _assert_skipped_and_fell_back(scenario, scenario.victim)


def test_truncated_to_nothing(scenario):
    open(scenario.victim_path, "wb").close()
    _assert_verify_fails(scenario, scenario.victim)
    _assert_skipped_and_fell_back(scenario, scenario.victim)


def test_deleted_chunk(scenario):
    os.remove(scenario.victim_path)
    _assert_verify_fails(scenario, scenario.victim[:16], "missing")
    _assert_skipped_and_fell_back(scenario, scenario.victim[:16], "missing")


def test_several_damaged_chunks_are_all_reported(scenario):
    assert len(scenario.only_bad) >= 3
    victims = scenario.only_bad[:3]
    os.remove(_path(scenario.root, fmt.chunk_key(victims[0])))
    _flip_byte(_path(scenario.root, fmt.chunk_key(victims[1])), 20)
    with open(_path(scenario.root, fmt.chunk_key(victims[2])), "r+b") as f:
        f.truncate(5)
    problems = _assert_verify_fails(scenario, victims[0][:16], victims[1], victims[2])
    assert len(problems) == 3
    _assert_skipped_and_fell_back(scenario)


def test_damaged_shared_chunk_leaves_nothing_to_restore(scenario, tiny_train_step):
    assert scenario.shared  # the frozen tensor's chunks
    _flip_byte(_path(scenario.root, fmt.chunk_key(scenario.shared[0])), 20)
    assert not scenario.verify(GOOD).ok and not scenario.verify(BAD).ok
    live = scenario.state
    tiny_train_step(live)
    before = _model_snapshot(live)
    with pytest.raises(NoValidCheckpointError) as err:
        scenario.ck.restore(live)
    assert [s for s, _ in err.value.skipped] == [BAD, GOOD]
    assert all(scenario.shared[0] in reason for _, reason in err.value.skipped)
    _assert_model_equals(live, before)  # the live state is never half-restored


# ---- manifest damage ----------------------------------------------------------------------


def test_corrupted_manifest_byte(scenario):
    blob = open(scenario.manifest_path, "rb").read()
    # flip a digit of the commit time: still valid JSON, so only the checksum can catch it
    pos = blob.index(b'"committed_at":') + len(b'"committed_at":') + 2
    assert chr(blob[pos]).isdigit()
    new_digit = b"0" if blob[pos : pos + 1] != b"0" else b"1"
    with open(scenario.manifest_path, "r+b") as f:
        f.seek(pos)
        f.write(new_digit)
    json.loads(open(scenario.manifest_path, "rb").read())  # still parses
    _assert_verify_fails(scenario, "manifest", fmt.manifest_key(RUN, BAD), "checksum")
    _assert_skipped_and_fell_back(scenario, fmt.manifest_key(RUN, BAD), "checksum")
    with Checkpointer(scenario.root, run=RUN) as ck:
        assert [i.step for i in ck.list()] == [GOOD]


def test_manifest_byte_flip_breaking_json(scenario):
    blob = open(scenario.manifest_path, "rb").read()
    _flip_byte(scenario.manifest_path, len(blob) // 2)
    _assert_verify_fails(scenario, fmt.manifest_key(RUN, BAD))
    _assert_skipped_and_fell_back(scenario, fmt.manifest_key(RUN, BAD))


def test_missing_manifest_with_rank_records_present(scenario):
    os.remove(scenario.manifest_path)
    assert os.path.exists(scenario.rank_path)
    _assert_verify_fails(scenario, fmt.manifest_key(RUN, BAD), "never committed")
    _assert_skipped_and_fell_back(scenario, "never committed")
    with Checkpointer(scenario.root, run=RUN) as ck:
        assert [i.step for i in ck.list()] == [GOOD]


def _rewrite_manifest(path: str, mutate) -> None:
    record = json.loads(open(path, "rb").read())
    record.pop("checksum")
    mutate(record)
    with open(path, "wb") as f:
        f.write(seal(record))


@pytest.mark.parametrize(
    "field", ["run", "step", "kind", "stats", "dcp", "chunks", "world_size", "created_at", "format_version", "address"]
)
def test_malformed_manifest_missing_field(scenario, field):
    _rewrite_manifest(scenario.manifest_path, lambda r: r.pop(field))
    with pytest.raises(ManifestError) as err:
        catalog.read_manifest(scenario.store, RUN, BAD)
    message = str(err.value)
    assert fmt.manifest_key(RUN, BAD) in message
    if field != "format_version":
        assert f"lacks field {field!r}" in message
    else:
        assert "format_version" in message
    _assert_verify_fails(scenario, fmt.manifest_key(RUN, BAD))
    _assert_skipped_and_fell_back(scenario, fmt.manifest_key(RUN, BAD))
    with Checkpointer(scenario.root, run=RUN) as ck:
        assert [i.step for i in ck.list()] == [GOOD]


def test_manifest_copied_to_wrong_step(scenario):
    # a valid, sealed manifest of GOOD placed where BAD's belongs
    with open(_path(scenario.root, fmt.manifest_key(RUN, GOOD)), "rb") as f:
        good_blob = f.read()
    with open(scenario.manifest_path, "wb") as f:
        f.write(good_blob)
    _assert_verify_fails(scenario, "wrong place")
    _assert_skipped_and_fell_back(scenario, "wrong place")


# ---- rank record damage -------------------------------------------------------------------


def test_missing_rank_record(scenario):
    os.remove(scenario.rank_path)
    _assert_verify_fails(scenario, scenario.rank_key, "missing")
    _assert_skipped_and_fell_back(scenario, scenario.rank_key)


def test_corrupted_rank_record(scenario):
    blob = open(scenario.rank_path, "rb").read()
    _flip_byte(scenario.rank_path, len(blob) // 2)
    _assert_verify_fails(scenario, scenario.rank_key)
    _assert_skipped_and_fell_back(scenario, scenario.rank_key)


# ---- after a fallback, training goes on ---------------------------------------------------


def test_resave_over_rejected_step_after_fallback(scenario, tiny_train_step):
    os.remove(scenario.victim_path)
    ck = scenario.ck
    live = scenario.state
    result = ck.restore(live)
    assert result.step == GOOD and [s for s, _ in result.skipped] == [BAD]
    # the job replays from GOOD and reaches BAD again: saving there is allowed
    tiny_train_step(live, 2)
    expected = _model_snapshot(live)
    res = ck.save(BAD, live, metadata={"which": "resaved"})
    assert res.step == BAD and res.info.base_step == GOOD
    quarantine = os.listdir(os.path.join(scenario.root, "runs", RUN, "quarantine"))
    assert len(quarantine) == 1 and quarantine[0].startswith(f"{BAD:012d}-")
    assert scenario.verify(BAD).ok
    fresh, again = scenario.restore_fresh()
    assert again.step == BAD and again.skipped == [] and again.metadata == {"which": "resaved"}
    _assert_model_equals(fresh, expected)


def test_manifest_checksum_covers_content_not_formatting(scenario):
    # reformatting (not re-sealing) a manifest keeps its content but the file is still
    # accepted: the checksum is over canonical JSON, not over the bytes
    record = json.loads(open(scenario.manifest_path, "rb").read())
    with open(scenario.manifest_path, "w") as f:
        json.dump(copy.deepcopy(record), f, indent=2)
    manifest = catalog.read_manifest(scenario.store, RUN, BAD)
    assert manifest.step == BAD
    # but changing any value is caught
    record["metadata"] = {"which": "forged"}
    with open(scenario.manifest_path, "w") as f:
        json.dump(record, f)
    with pytest.raises(ManifestError, match="checksum"):
        catalog.read_manifest(scenario.store, RUN, BAD)


def _set_unknown_dtype(record):
    record["dcp"]["items"][0]["dtype"] = "float99"


def _drop_item_chunks(record):
    record["dcp"]["items"][0].pop("chunks")


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda r: r.update(dcp={}), id="dcp-empty"),
        pytest.param(lambda r: r.update(dcp=[]), id="dcp-list"),
        pytest.param(lambda r: r.update(chunks=[]), id="chunks-list"),
        pytest.param(lambda r: r.update(chunks={"ab": "12"}), id="chunks-size-str"),
        pytest.param(lambda r: r.update(stats={}), id="stats-empty"),
        pytest.param(lambda r: r.update(world_size="1"), id="world-size-str"),
        pytest.param(lambda r: r.update(world_size=0), id="world-size-zero"),
        pytest.param(lambda r: r.update(step=str(BAD)), id="step-str"),
        pytest.param(_set_unknown_dtype, id="unknown-dtype"),
        pytest.param(_drop_item_chunks, id="item-without-chunks"),
    ],
)
def test_malformed_manifest_wrong_shape(scenario, mutate):
    """Sealed (checksum valid) but structurally wrong: reported, skipped, never a crash."""
    _rewrite_manifest(scenario.manifest_path, mutate)
    report = scenario.verify(BAD)
    assert report.ok is False
    assert any(fmt.manifest_key(RUN, BAD) in p or "manifest" in p for p in report.problems), report.problems
    with Checkpointer(scenario.root, run=RUN) as ck:
        assert [i.step for i in ck.list()] == [GOOD]
    _assert_skipped_and_fell_back(scenario, "manifest")


# ---- one set of rules: verify, restore and export agree ---------------------------------
@pytest.mark.parametrize(
    "mutate, why",
    [
        pytest.param(grow_first_tensor, "that do not tile it: no piece covers", id="tensor-larger-than-its-shards"),
        pytest.param(
            lambda r: r["dcp"]["tensors"][next(iter(r["dcp"]["tensors"]))]["chunks"].append(
                r["dcp"]["tensors"][next(iter(r["dcp"]["tensors"]))]["chunks"][0]
            ),
            "overlap in",
            id="shard-twice",
        ),
        pytest.param(lambda r: r["dcp"]["items"][0].update(chunks=[]), "adding up", id="item-without-chunk-bytes"),
    ],
)
def test_a_manifest_whose_shards_do_not_cover_a_tensor_fails_everywhere_alike(scenario, tmp_path, mutate, why):
    reseal_manifest(scenario.root, RUN, BAD, mutate)
    _assert_verify_fails(scenario, why)
    _assert_skipped_and_fell_back(scenario, why)
    with pytest.raises(CkptflowError, match=why):
        export_safetensors(scenario.root, RUN, tmp_path / "m.safetensors", step=BAD)
    # and the default export, like restore, takes the newest checkpoint that is whole
    assert export_safetensors(scenario.root, RUN, tmp_path / "m.safetensors").step == GOOD


def test_chunk_bytes_must_be_positive(ckpt_store_dir):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunk_bytes must be a positive"):
            Checkpointer(ckpt_store_dir, run=RUN, chunk_bytes=bad)
    assert not os.path.exists(os.path.join(ckpt_store_dir, "runs"))


REFUSED = [{"run": "a b"}, {"chunk_bytes": 0}, {"pack_bytes": -1}, {"codec": "gzip"}, {"restore_buffer_bytes": -1}]


@pytest.mark.parametrize("bad", REFUSED)
def test_a_refused_argument_creates_nothing(tmp_path, bad):
    """Refused before the store is opened: a typo leaves no empty store behind."""
    root = tmp_path / "never"
    with pytest.raises((ValueError, CkptflowError)):
        Checkpointer(str(root), **{"run": RUN, **bad})
    assert not root.exists()
