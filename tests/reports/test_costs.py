"""The cost model: bytes and monthly cost per tier, and savings that add up exactly to
the difference between every checkpoint raw and hot and what the stores hold now."""

import json

import pytest
import torch

from ckptflow import Checkpointer, gc, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks.lossy import ArchiveCodec
from ckptflow.format import layout as fmt
from ckptflow.reports.costs import DEFAULT_PRICES, GB, SAVINGS, CostModel, item, storage_costs
from ckptflow.reports.stats import chunk_file_sizes
from ckptflow.store import open_store
from support.cli import run_cli
from support.states import DRIFT_CHUNK, drifting_state

RUN = "c"


@pytest.fixture
def tiers(tmp_path):
    """Hot: full 1, incrementals 2-3 (deltas), full 4; step 2 archived lossily and step 1
    archived exactly, then step 1 expired from every tier (the ledger remembers it)."""
    hot, arc = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "arc"))
    with Checkpointer(hot, RUN, codec="auto", chunk_bytes=DRIFT_CHUNK) as ck:
        for step in (1, 2, 3, 4):
            ck.save(step, drifting_state(step), kind="full" if step in (1, 4) else "incremental")
    assert lifecycle.archive(hot, arc, RUN, 2, codec=ArchiveCodec.parse("bf16")).ok
    expired = catalog.read_manifest(hot, RUN, 1)
    lifecycle.expire(hot, RUN, 1)
    return hot, arc, expired


def test_savings_add_up_to_baseline_minus_what_the_stores_cost(tiers):
    hot, arc, expired = tiers
    model = CostModel()
    report = storage_costs(hot, arc, model=model)
    held = {m.ref: m.stats.logical_bytes for m in catalog.committed(hot)}
    assert report.baseline_bytes == sum(held.values()) + expired.stats.logical_bytes
    assert report.baseline_usd == pytest.approx(report.baseline_bytes / GB * DEFAULT_PRICES["STANDARD"])
    assert report.baseline_usd - sum(report.savings_usd.values()) == pytest.approx(report.monthly_usd, rel=1e-9)
    assert report.savings_bytes["retention"] == expired.stats.logical_bytes
    for name in ("dedup", "compression", "delta", "lossy"):
        assert report.savings_bytes[name] > 0, name
    by_tier = {t.tier: t for t in report.tiers}
    assert by_tier["hot"].stored_bytes == sum(chunk_file_sizes(hot).values())
    assert by_tier["archive"].stored_bytes == sum(chunk_file_sizes(arc).values())
    assert by_tier["archive"].monthly_usd == pytest.approx(by_tier["archive"].stored_bytes / GB * 0.004)
    # a duplicate copy in the archive costs money: tiering saved nothing yet
    assert report.savings_usd["tiering"] < 0


def test_stats_prints_cost_per_tier_and_savings(tiers, tmp_path, capsys):
    hot, arc, _ = tiers
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"prices": {"ONPREM": 0.01}, "tiers": {"hot": "ONPREM"}}))
    code, out, _ = run_cli(capsys, "stats", hot.root, "--archive", arc.root, "--prices", str(prices))
    assert code == 0
    assert "ONPREM" in out and "GLACIER_IR" in out and "saved by delta" in out and "saved by retention" in out
    code, out, _ = run_cli(
        capsys, "stats", hot.root, "--archive", arc.root, "--archive-class", "DEEP_ARCHIVE", "--json"
    )
    costs = json.loads(out)["costs"]
    assert {t["storage_class"] for t in costs["tiers"]} == {"STANDARD", "DEEP_ARCHIVE"}
    assert set(costs["savings_usd"]) == set(SAVINGS)


def test_a_tier_priced_as_an_unknown_class_is_refused(tiers, capsys):
    with pytest.raises(ValueError, match="no price"):
        CostModel(tiers={"hot": "PLATINUM"})
    code, _, err = run_cli(capsys, "stats", tiers[0].root, "--hot-class", "PLATINUM")
    assert code == 2 and "PLATINUM" in err


def test_a_step_committed_again_after_its_expiry_is_another_checkpoint_in_the_baseline(tmp_path):
    """The ledger records commits: keyed by (run, step), an expired commit whose step now
    holds another one fell out of the baseline and of what retention saved (1 MiB, not 2)."""
    hot = open_store(str(tmp_path))
    with Checkpointer(hot, RUN) as ck:
        ck.save(1, {"w": torch.zeros(1 << 18)})
    first = catalog.read_manifest(hot, RUN, 1)
    lifecycle.expire(hot, RUN, 1)
    with Checkpointer(hot, RUN) as ck:
        ck.save(1, {"w": torch.ones(1 << 18)})  # training saved step 1 again: another commit
    report = storage_costs(hot)
    again = catalog.read_manifest(hot, RUN, 1)
    assert again.digest != first.digest
    assert report.baseline_bytes == first.stats.logical_bytes + again.stats.logical_bytes == 2 << 20
    assert report.savings_bytes["retention"] == first.stats.logical_bytes
    assert report.baseline_usd - sum(report.savings_usd.values()) == pytest.approx(report.monthly_usd, rel=1e-9)


@pytest.mark.parametrize(
    "text", ['{"prices": [0.02]}', '{"tiers": "STANDARD"}', '{"tiers": {"hot": ["STANDARD"]}}', '{"prices": null}']
)
def test_a_price_file_of_the_wrong_shape_is_one_clear_error_not_a_traceback(tmp_path, capsys, text):
    """``stats --prices`` and ``advise --prices`` catch ValueError: the wrong shape was a TypeError
    out of ``from_json`` and the command printed a traceback."""
    with pytest.raises(ValueError, match="'prices' must be|'tiers' maps"):
        CostModel.from_json(text)
    prices = tmp_path / "prices.json"
    prices.write_text(text)
    code, _, err = run_cli(capsys, "stats", str(tmp_path), "--prices", str(prices))
    assert code == 2 and "prices.json" in err and "Traceback" not in err


def test_the_chunks_gc_keeps_for_a_damaged_commit_record_are_priced_not_dropped(tmp_path):
    """A commit record failing its checksum is no checkpoint (not held) and its chunks are not
    garbage (GC keeps what its JSON names), but the tier holds and pays for them: they were
    left out of the tier's stored bytes and its monthly cost (16 KiB of 32 KiB here)."""
    hot = open_store(str(tmp_path))
    with Checkpointer(hot, RUN) as ck:
        ck.save(1, {"model": {"w": torch.zeros(4096)}})
        ck.save(2, {"model": {"w": torch.ones(4096)}})
    record = tmp_path / fmt.manifest_key(RUN, 2)
    record.write_bytes(record.read_bytes().replace(b'"step":2', b'"step":3'))  # fails its checksum, still JSON
    sizes, held = chunk_file_sizes(hot), catalog.read_manifest(hot, RUN, 1).chunks
    report = storage_costs(hot)
    (tier,) = report.tiers
    assert tier.stored_bytes == sum(sizes.values()) and tier.checkpoints == 1
    assert report.savings_bytes["garbage"] == 0  # GC would sweep none of it
    assert report.savings_bytes["unreadable"] == -sum(n for d, n in sizes.items() if d not in held) < 0
    assert report.baseline_usd - sum(report.savings_usd.values()) == pytest.approx(report.monthly_usd, rel=1e-9)


def test_unreferenced_chunks_are_not_garbage_while_a_commit_record_is_not_json(tmp_path):
    """A commit record that is not JSON: GC cannot tell its chunks and sweeps nothing, yet the
    report priced every unreferenced chunk as 'garbage (unreferenced chunk files, until gc)'
    (16 KiB here), which no gc would ever collect until the record is repaired or deleted."""
    hot = open_store(str(tmp_path))
    with Checkpointer(hot, RUN) as ck:
        ck.save(1, {"model": {"w": torch.zeros(4096)}})
        ck.save(2, {"model": {"w": torch.ones(4096)}})
    (tmp_path / fmt.manifest_key(RUN, 2)).write_bytes(b"\x00 not a commit record")
    sizes, held = chunk_file_sizes(hot), catalog.read_manifest(hot, RUN, 1).chunks
    unheld = sum(n for d, n in sizes.items() if d not in held)
    gc_report = gc(hot, grace=0, dry_run=True)
    assert gc_report.skipped is not None and gc_report.deleted == []  # what a gc does in this state
    report = storage_costs(hot)
    assert report.savings_bytes["garbage"] == 0 and report.savings_usd["garbage"] == 0
    assert report.savings_bytes["unreadable"] == -unheld < 0
    assert item("unreadable", report.savings_usd["unreadable"], -unheld) == (
        "chunks held for unreadable commit records (gc keeps them until each is repaired or deleted)",
        "adds",
    )
    assert report.baseline_usd - sum(report.savings_usd.values()) == pytest.approx(report.monthly_usd, rel=1e-9)
