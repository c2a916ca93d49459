"""Lossy archive codecs: explicit, recorded, refused by restore unless allowed.

A lossy copy is written to the archive tier with what it lost in its manifest;
restore skips it (saying why) without ``allow_lossy=True`` and says what it restored
with it; a model-only copy leaves the optimizer as it was; archival re-evaluates the
copy and records the metric change; retention never lets the exact copy of a pinned,
published or aliased checkpoint go when the archive copy is lossy.
"""

import numpy as np
import pytest
import torch
from torch import nn

from ckptflow import Checkpointer, NoValidCheckpointError, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks.lossy import ArchiveCodec, LossStats, describe, encode_lossy
from ckptflow.chunks.reads import ChunkReader
from ckptflow.lifecycle.retention_apply import copy_matches
from ckptflow.policy.retention import DAY, Candidate, plan
from ckptflow.reports import inventory
from ckptflow.store import open_store

RUN = "l"


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        loss = model(torch.randn(32, 64)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
    return {"model": model, "optim": optim, "epoch": 3}


def _archive(tmp_path, codec: str, *, saved_with: str = "raw", **kwargs):
    hot, arc = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "arc"))
    state = _state()
    with Checkpointer(hot, RUN, codec=saved_with) as ck:
        ck.save(1, state)
    report = lifecycle.archive(hot, arc, RUN, 1, codec=ArchiveCodec.parse(codec), **kwargs)
    assert report.ok, report.problems
    return hot, arc, state, report


def _params(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state["model"].state_dict().items()}


def _moments(state: dict) -> list[torch.Tensor]:
    return [s[k].clone() for s in state["optim"].state.values() for k in ("exp_avg", "exp_avg_sq")]


def test_a_lossy_copy_records_what_it_lost_and_is_much_smaller(tmp_path):
    hot, arc, _, report = _archive(tmp_path, "bf16+int8")
    exact, copy = catalog.read_manifest(hot, RUN, 1), catalog.read_manifest(arc, RUN, 1)
    assert copy.lossy is not None and report.lossy == dict(copy.lossy)
    assert copy.lossy["weights"] == "bf16" and copy.lossy["optimizer"] == "int8"
    assert copy.lossy["source_digest"] == exact.digest and report.archive_digest == copy.digest
    assert copy.lossy["tensors"]["bf16"] == 4 and copy.lossy["tensors"]["int8"] == 8
    assert 0 < copy.lossy["error"]["weights"]["rms_relative_error"] < 0.01
    assert copy.stats.stored_bytes < 0.4 * exact.stats.stored_bytes
    assert catalog.verify_checkpoint(arc, RUN, 1).ok
    assert "weights rounded to bf16" in describe(copy.lossy)
    assert lifecycle.read_record(hot, lifecycle.Subject.of(exact), "archive")["lossy"]["codec"] == copy.lossy["codec"]


@pytest.mark.parametrize("saved_with", ["raw", "zstd"])
def test_restore_refuses_a_lossy_copy_unless_allowed_and_says_what_it_restored(tmp_path, saved_with):
    """From a raw or a zstd save alike: the copy's chunks are new objects, so it keeps
    none of the checksums the zstd save recorded of its stored chunks."""
    hot, arc, state, _ = _archive(tmp_path, "bf16+int8", saved_with=saved_with)
    assert bool(catalog.read_manifest(hot, RUN, 1).stored_checksums) == (saved_with == "zstd")
    assert not catalog.read_manifest(arc, RUN, 1).stored_checksums
    expected = {k: v.bfloat16().float() for k, v in _params(state).items()}
    lifecycle.expire(hot, RUN, 1, keep_records=True)
    target = _state(seed=7)
    before = _params(target)
    with Checkpointer(hot, RUN, tiers=[arc]) as ck:
        with pytest.raises(NoValidCheckpointError, match="lossy archive copy.*allow_lossy=True") as refused:
            ck.restore(target)
        assert refused.value.skipped and all(torch.equal(v, before[k]) for k, v in _params(target).items())
        result = ck.restore(target, allow_lossy=True)
    assert result.step == 1 and result.tier == arc.url and result.lossy["weights"] == "bf16"
    assert result.not_restored == []
    assert all(torch.equal(v, expected[k]) for k, v in _params(target).items())
    for got, want in zip(_moments(target), _moments(state)):
        assert torch.allclose(got, want, atol=float(want.abs().max()) / 127)


def test_a_model_only_copy_restores_the_model_and_leaves_the_optimizer_as_it_was(tmp_path):
    hot, arc, state, _ = _archive(tmp_path, "model-only")
    copy = catalog.read_manifest(arc, RUN, 1)
    assert copy.lossy["dropped"] == ["optim"] and not any(f.startswith("optim.") for f in copy.dcp.tensors)
    lifecycle.expire(hot, RUN, 1, keep_records=True)
    target = _state(seed=7)
    moments = _moments(target)
    with Checkpointer(hot, RUN, tiers=[arc]) as ck:
        result = ck.restore(target, allow_lossy=True)
    assert result.not_restored == ["optim"] and result.lossy["optimizer"] == "drop"
    assert all(torch.equal(v, _params(state)[k]) for k, v in _params(target).items())  # weights exact
    assert all(torch.equal(a, b) for a, b in zip(_moments(target), moments))
    assert target["epoch"] == 3


def test_archival_reevaluates_the_lossy_copy_next_to_the_exact_one(tmp_path):
    def evaluator(tensors, info):
        return {"weight_sum": float(sum(t.double().sum() for t in tensors.values()))}

    _, _, state, report = _archive(tmp_path, "bf16", evaluator=evaluator, evaluator_name="sum")
    exact = sum(t.double().sum() for t in _params(state).values())
    rounded = sum(t.bfloat16().double().sum() for t in _params(state).values())
    evaluation = report.evaluation
    assert evaluation["evaluator"] == "sum"
    assert evaluation["metrics_exact"]["weight_sum"] == pytest.approx(float(exact))
    assert evaluation["metric_change"]["weight_sum"] == pytest.approx(float(rounded - exact), rel=1e-6)


def test_a_verified_lossy_copy_lets_retention_expire_the_hot_copy(tmp_path):
    hot, arc, _, _ = _archive(tmp_path, "bf16+int8")
    assert copy_matches(hot, arc, RUN, 1) is None


def test_an_archive_already_holding_the_exact_copy_keeps_it(tmp_path):
    hot, arc = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "arc"))
    with Checkpointer(hot, RUN) as ck:
        ck.save(1, _state())
    assert lifecycle.archive(hot, arc, RUN, 1).ok
    report = lifecycle.archive(hot, arc, RUN, 1, codec=ArchiveCodec.parse("bf16+int8"))
    assert report.ok and report.lossy is None and catalog.read_manifest(arc, RUN, 1).lossy is None


def test_retention_keeps_exact_copies_of_pinned_published_and_aliased_checkpoints():
    now = 100 * DAY
    old = now - 20 * DAY

    def cand(step, *, lossy):
        return Candidate(
            run="r",
            step=step,
            kind="full",
            created_at=old,
            valid=True,
            archived=True,
            archive_lossy=lossy,
            digest=f"d{step}",
        )

    checkpoints = [
        cand(1, lossy=True),
        cand(2, lossy=True),
        cand(3, lossy=True),
        cand(4, lossy=False),
        cand(9, lossy=False),
    ]
    aliased = {("r", 2, "d2"): ["stable"], ("r", 4, "d4"): ["latest"]}
    result = plan(checkpoints, now, pinned={("r", 1, "d1")}, aliased=aliased, hot_days=7)
    assert ("r", 1) not in result.archive_only and ("r", 2) not in result.archive_only  # exact copy stays hot
    assert ("r", 3) in result.archive_only  # unprotected: the lossy copy will do
    assert ("r", 4) in result.archive_only  # protected, but its archive copy is exact


@pytest.mark.parametrize(
    "text, weights, optimizer",
    [
        ("bf16+int8", "bf16", "int8"),
        ("model-only", "exact", "drop"),
        ("weights=bf16,optimizer=drop", "bf16", "drop"),
        (None, "exact", "exact"),
    ],
)
def test_archive_codec_settings(text, weights, optimizer):
    codec = ArchiveCodec.parse(text)
    assert (codec.weights, codec.optimizer) == (weights, optimizer)


def test_a_bad_archive_codec_says_what_is_allowed():
    with pytest.raises(ValueError, match="preset"):
        ArchiveCodec.parse("fp4")
    with pytest.raises(ValueError, match="weights must be one of"):
        ArchiveCodec.parse("weights=fp8")


def test_the_inventory_shows_an_archive_only_lossy_copy_with_the_exact_commits_verdicts(tmp_path):
    hot, arc, _, _ = _archive(tmp_path, "bf16+int8")
    lifecycle.validate(hot, RUN, 1)
    lifecycle.expire(hot, RUN, 1, keep_records=True)
    [entry] = inventory.collect(hot, arc)
    assert entry.tiers == ["archive"] and entry.validation == "passed"
    assert entry.archive_lossy["weights"] == "bf16" and entry.candidate().archive_lossy
    assert inventory.rows([entry])[0]["archive_copy"] == "lossy"


def test_a_lossy_copy_reads_each_pack_once_and_stores_every_member_alone(tmp_path, monkeypatch):
    """Members are packed in the model's order (layers.0, 1, 2, ..., 10) but listed by name
    (layers.0, 1, 10, ..., 2): the copy still reads and verifies each pack once."""
    hot, arc = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "arc"))
    model = nn.Sequential(*(nn.LayerNorm(64) for _ in range(40)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    with Checkpointer(hot, RUN, pack_bytes=4096) as ck:
        ck.save(1, {"model": model}, rng=False)
    exact = catalog.read_manifest(hot, RUN, 1)
    packs = {i.chunks[0][0] for i in exact.items() if i.packed_at is not None}
    assert len(packs) == 5  # 80 tensors of 256 bytes, 16 to a pack
    reads: dict[str, int] = {}
    real_get = ChunkReader.get

    def counted(self, digest, size):
        reads[digest] = reads.get(digest, 0) + 1
        return real_get(self, digest, size)

    monkeypatch.setattr(ChunkReader, "get", counted)
    report = lifecycle.archive(hot, arc, RUN, 1, codec=ArchiveCodec.parse("bf16"))
    assert report.ok, report.problems
    assert {d: reads[d] for d in packs} == dict.fromkeys(packs, 1)
    copy = catalog.read_manifest(arc, RUN, 1)
    assert all(i.packed_at is None for i in copy.items()) and [i.fqn for i in copy.items()] == [
        i.fqn for i in exact.items()
    ]
    lifecycle.expire(hot, RUN, 1, keep_records=True)
    target = nn.Sequential(*(nn.LayerNorm(64) for _ in range(40)))
    with Checkpointer(hot, RUN, tiers=[arc]) as ck:
        ck.restore({"model": target}, allow_lossy=True)
    for (name, got), want in zip(target.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want.bfloat16().float()), name


def test_the_error_figures_of_a_chunk_holding_a_nan_do_not_depend_on_the_order_of_the_chunks():
    """A NaN weight: bf16 keeps it (no error), int8 keeps its chunk exact (test_lossy_nonfinite).
    max_abs_error was max(previous, NaN), which kept the previous figure while the RMS went
    NaN; bf16's RMS went NaN too although nothing was lost."""
    with_nan = np.array([1.0, np.nan, 3.0], dtype="<f4")
    finite = np.array([1.1, 2.0, 3.3], dtype="<f4")
    figures = {}
    for how in ("bf16", "int8"):
        for order in ((with_nan, finite), (finite, with_nan)):
            stats = LossStats()
            for chunk in order:
                encode_lossy(memoryview(chunk.tobytes()), how, stats, "weights", name="w")
            figures.setdefault(how, []).append(stats.as_dict()["weights"])
    int8 = figures["int8"][0]  # the finite chunk's error only: the NaN's chunk was kept exact
    assert figures["int8"][1] == int8 and 0 < int8["rms_relative_error"] < 0.01 and 0 < int8["max_abs_error"] < 0.01
    bf16 = figures["bf16"][0]
    assert figures["bf16"][1] == bf16 and 0 < bf16["rms_relative_error"] < 0.01 and 0 < bf16["max_abs_error"] < 0.01
