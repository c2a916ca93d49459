"""The one walk over a store: every unreadable checkpoint is a problem on its own line.

ls, stats, gc, verify --all, the inventory and the landing sensor all walk the store
through ``catalog`` and ``catalog_listing``; a checkpoint that is corrupt, denied, cold or badly placed must
show up as that checkpoint's problem and never end the whole walk.
"""

import os

import pytest
import torch

from ckptflow import Checkpointer, ColdObjectError, Manifest, Problem, gc
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import listing as catalog_listing
from ckptflow.format import layout as fmt
from ckptflow.reports import inventory, stats
from ckptflow.store import open_store
from support.cli import run_cli
from support.corrupt import flip_byte, manifest_path
from support.faulty_store import FaultyStore

RUN = "r"


@pytest.fixture
def root(tmp_path):
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN, chunk_bytes=256) as ck:
        for step in (1, 2, 3, 4):
            ck.save(step, {"w": torch.full((64,), float(step))})
    return root


def hostile(root):
    """Step 2's manifest corrupt, a stray 'runs/a__b' directory, step 5 a file, not a directory."""
    flip_byte(manifest_path(root, RUN, 2), 40)
    os.makedirs(os.path.join(root, "runs", "a__b", "checkpoints"))
    os.makedirs(os.path.join(root, "runs", "x" * 200, "checkpoints"))  # longer than any run name
    with open(os.path.join(root, "runs", RUN, "checkpoints", f"{5:012d}"), "wb") as f:
        f.write(b"not a directory")


def test_committed_reports_each_unreadable_checkpoint_and_goes_on(root):
    hostile(root)
    store = FaultyStore(open_store(root))

    def fail(op, key):
        if op == "get" and key == fmt.manifest_key(RUN, 3):
            raise PermissionError(13, "Permission denied", key)
        if op == "get" and key == fmt.manifest_key(RUN, 4):
            raise ColdObjectError(f"{key} is in GLACIER")
        return False

    store.fail_if = fail
    items = list(catalog.committed(store))
    problems = {(p.run, p.step): p.kind for p in items if isinstance(p, Problem)}
    assert [m.step for m in items if isinstance(m, Manifest)] == [1]
    assert problems == {
        ("a__b", None): "bad_name",
        ("x" * 200, None): "bad_name",
        (RUN, 2): "corrupt",
        (RUN, 3): "denied",
        (RUN, 4): "cold",
        (RUN, 5): "not_a_directory",
    }
    entries = {e.step: e for e in inventory.collect(store)}
    assert entries[1].validation == "not checked" and entries[2].validation == "failed"
    assert "Permission denied" in entries[3].manifest_error and "GLACIER" in entries[4].manifest_error
    assert entries[3].validation == entries[4].validation == "unreadable"  # no verdict: nothing was read
    plan = inventory.retention_plan(list(entries.values()), now=4e9)  # long after every age rule
    assert (RUN, 2) in plan.delete  # proof of damage
    assert all("could not be read" in plan.keep[(RUN, step)][0] for step in (3, 4))
    counted = stats.store_stats(store)
    assert counted.checkpoints == 1 and len(counted.unreadable_manifests) == 6


def test_cli_and_gc_report_problems_per_checkpoint(root, capsys):
    hostile(root)
    code, out, err = run_cli(capsys, "ls", root)
    assert code == 0 and [line.split()[1] for line in out.splitlines()[1:]] == ["1", "3", "4"]
    assert "a__b" in err and "step 2" in err and "step 5" in err and "is a file where a step directory belongs" in err
    code, out, err = run_cli(capsys, "stats", root)
    assert code == 0 and "not counted" in err
    code, out, err = run_cli(capsys, "verify", root, "--run", RUN, "--all")
    assert code == 1
    assert any(line.startswith(f"run {RUN} step 2:") and "corrupt" in line for line in out.splitlines())
    assert any(line.startswith(f"run {RUN} step 5:") for line in out.splitlines())
    report = gc(root, grace="0s", dry_run=True)
    assert report.skipped and f"run {RUN} step 2" in report.skipped and not report.deleted  # its chunks are unknown
    assert any("a__b" in p for p in report.ignored)


def test_a_commit_record_that_cannot_be_read_stops_gc_but_names_itself(root):
    store = FaultyStore(open_store(root))
    store.fail_if = lambda op, key: op == "get" and key == fmt.manifest_key(RUN, 2)
    report = gc(store, grace="0s")
    assert report.skipped and fmt.manifest_key(RUN, 2) in report.skipped and report.deleted == []


def test_step_dirs_names_each_step_once_committed_or_not(root):
    """What restore's candidate search lists in the hot tier: directory names only, one
    per step however many files (ranks) it holds; a file where a step belongs is not one."""
    hostile(root)
    os.makedirs(os.path.join(root, "runs", RUN, "checkpoints", f"{7:012d}", "ranks"))  # a save that died
    os.makedirs(os.path.join(root, "runs", RUN, "checkpoints", "notastep"))
    assert catalog_listing.step_dirs(open_store(root), RUN) == [1, 2, 3, 4, 7]
    assert catalog_listing.step_dirs(open_store(root), "nothing-here") == []


def test_a_listing_from_a_step_holds_that_step_and_the_newer_ones(root):
    store = FaultyStore(open_store(root), count_reads=True)
    listed = [
        e.step
        for e in catalog_listing.listing(store, from_steps={RUN: 3})
        if isinstance(e, catalog_listing.StepListing)
    ]
    assert listed == [3, 4]
    assert [op for _, op, _ in store.log] == ["list", "list_after"]


def test_a_listing_of_commit_records_names_each_steps_ranks_once(tmp_path):
    """Four ranks' records of a step are one entry of a ``manifests_only`` listing, and
    what ls reads (the summaries) is the same as from a full listing."""
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        ck.save(1, {"w": torch.ones(4)})
    store = open_store(root)
    ranks = fmt.step_prefix(RUN, 1) + "ranks/"
    record = next(store.list(ranks)).key
    for rank in (1, 2, 3):  # stand-ins: only the listing is looked at
        store.replace(record.replace("/0.", f"/{rank}."), store.get(record))
    [full] = [e for e in catalog_listing.listing(store, RUN) if isinstance(e, catalog_listing.StepListing)]
    [rolled] = [
        e
        for e in catalog_listing.listing(store, RUN, manifests_only=True)
        if isinstance(e, catalog_listing.StepListing)
    ]
    assert sum(f.key.startswith(ranks) for f in full.files) == 4
    assert [f.key for f in rolled.files] == [fmt.manifest_key(RUN, 1), ranks] and rolled.manifest == full.manifest
    assert [i.step for i in catalog.list_checkpoints(store, RUN)] == [1]


class OneStepDenied(FaultyStore):
    """A local store where step 3's directory cannot be listed (another user's, mode 700)."""

    def list(self, prefix, *, recursive=True):
        denied = fmt.step_prefix(RUN, 3)
        for info in self.inner.list(prefix, recursive=recursive):
            if info.key.startswith(denied) and (recursive or prefix.startswith(denied)):
                raise PermissionError(13, "Permission denied", os.path.join(self.inner.root, denied))
            yield info

    def list_after(self, prefix, start_after="", *, roll_up=""):
        denied = fmt.step_prefix(RUN, 3)
        for info in self.inner.list_after(prefix, start_after, roll_up=roll_up):
            if info.key.startswith(denied):
                raise PermissionError(13, "Permission denied", os.path.join(self.inner.root, denied))
            yield info


def test_a_step_that_cannot_be_listed_is_that_steps_problem_not_the_whole_runs(root):
    """Before, one denied step directory made the run one problem: ``ls`` showed none of
    its checkpoints and said "no checkpoints"."""
    store = OneStepDenied(open_store(root))
    for manifests_only in (False, True):
        listed = list(catalog_listing.listing(store, manifests_only=manifests_only))
        assert [e.step for e in listed if isinstance(e, catalog_listing.StepListing)] == [1, 2, 4]
        [problem] = [e for e in listed if isinstance(e, Problem)]
        assert (problem.step, problem.kind) == (3, "denied") and "Permission denied" in problem.message
    assert [i.step for i in catalog.summaries(store, RUN) if not isinstance(i, Problem)] == [1, 2, 4]
    frontier = list(catalog_listing.listing(store, from_steps={RUN: 4}, manifests_only=True))  # a landing tick
    assert [(e.step, type(e).__name__) for e in frontier] == [(4, "StepListing")]
    assert gc(store, grace=0).skipped  # what step 3 references is unknown: nothing is swept


def test_a_file_where_a_runs_checkpoints_directory_belongs_is_a_problem_not_an_empty_run(root, capsys):
    """Before, the run listed as empty: verify --all said "0 checkpoints verified" (exit 0)
    and gc went on without a word about it."""
    checkpoints = os.path.join(root, "runs", RUN, "checkpoints")
    os.rename(checkpoints, checkpoints + ".moved")
    with open(checkpoints, "wb") as f:
        f.write(b"not a directory")
    [problem] = list(catalog_listing.listing(open_store(root), RUN))
    assert (problem.step, problem.kind) == (None, "not_a_directory") and "is a file where" in problem.message
    code, out, _ = run_cli(capsys, "verify", root, "--run", RUN, "--all")
    assert code == 1 and "is a file where the run's checkpoints directory belongs" in out
    code, _, err = run_cli(capsys, "gc", root, "--grace", "1h", "--dry-run")
    assert code == 0 and "left alone" in err and "is a file where" in err
