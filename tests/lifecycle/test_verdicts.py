"""A verdict needs proof: validation, scrub and ``ckptflow verify`` tell a checkpoint that
is damaged from one the store would not let them read (an S3 brownout), and only the
first is ever recorded as failed."""

import pytest

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.records import SMALL_RECORD_BYTES
from ckptflow.catalog.verdicts import record_key, records_by_subject
from ckptflow.errors import ColdObjectError, StoreUnavailableError
from ckptflow.store import open_store
from support.cli import RUN as CLI_RUN
from support.cli import make_store, run_cli
from support.corrupt import chunk_path, flip_byte, only_in
from support.faulty_store import FaultyStore
from support.states import drifting_state


def make(tmp_path):
    """Run ``r``, steps 1 and 2 (sharing some chunks); the store and its root."""
    root = str(tmp_path / "store")
    with Checkpointer(root, "r", chunk_bytes=4096) as ck:
        for step in (1, 2):
            ck.save(step, drifting_state(step))
    return open_store(root), root


def subject(store, step):
    return lifecycle.Subject.of(catalog.read_manifest(store, "r", step))


def unavailable(key: str) -> bool:
    raise StoreUnavailableError(f"S3 GetObject of {key} failed after 10 attempts: SlowDown")


def brownout(store, spare: str = "") -> FaultyStore:
    """``store`` whose chunk reads (but ``spare``'s) fail as an S3 backend's do after its own retries."""
    flaky = FaultyStore(store)
    flaky.fail_if = lambda op, key: key.startswith("chunks/") and not (spare and spare in key) and unavailable(key)
    return flaky


def test_an_outage_is_no_verdict_and_leaves_the_earlier_one(tmp_path):
    store, _ = make(tmp_path)
    report = catalog.verify_checkpoint(brownout(store), "r", 2)
    assert not report.ok and report.unavailable and not report.damaged
    with pytest.raises(StoreUnavailableError, match="no verdict was recorded"):
        lifecycle.validate(brownout(store), "r", 2)
    assert lifecycle.read_record(store, subject(store, 2), "validation") is None  # the landing sensor still asks
    good = lifecycle.validate(store, "r", 2)
    assert good["ok"] is True
    with pytest.raises(StoreUnavailableError):
        lifecycle.validate(brownout(store), "r", 2)
    assert lifecycle.read_record(store, subject(store, 2), "validation") == good  # not overwritten


def test_a_cold_chunk_among_unanswered_reads_is_no_verdict_and_says_to_thaw_first(tmp_path):
    """An outage passes with time; a cold chunk waits for a thaw, so validation says that
    (``ColdObjectError``, its thaw instruction first) rather than "retry when the store answers"."""
    store, _ = make(tmp_path)
    cold = sorted(catalog.read_manifest(store, "r", 2).chunks)[-1]

    def cold_or_unavailable(op, key):
        if key.startswith("chunks/") and cold in key:
            raise ColdObjectError(f"{key} is in GLACIER: run `ckptflow thaw {store.url} --run r --step 2`")
        return key.startswith("chunks/") and unavailable(key)

    flaky = FaultyStore(store)
    flaky.fail_if = cold_or_unavailable
    with pytest.raises(ColdObjectError) as err:
        lifecycle.validate(flaky, "r", 2)
    message = str(err.value)
    assert message.startswith(f"could not verify run r step 2 in {store.url}: chunks/") and "GLACIER" in message
    assert "SlowDown" not in message.split(" more)")[0] and message.endswith("thaw it, then validate again")
    assert lifecycle.read_record(store, subject(store, 2), "validation") is None


def test_proof_of_damage_is_a_verdict_whatever_else_could_not_be_read(tmp_path):
    store, root = make(tmp_path)
    damaged = only_in(root, "r", 2, 1)[0]
    flip_byte(chunk_path(root, damaged))
    flaky = brownout(store, spare=damaged)
    report = catalog.verify_checkpoint(flaky, "r", 2)
    assert report.damaged and not report.unavailable and any("SlowDown" in p for p in report.problems)
    record = lifecycle.validate(flaky, "r", 2)
    assert record["ok"] is False and any(damaged in p for p in record["problems"])


def test_scrub_during_an_outage_overwrites_no_verdict(tmp_path):
    store, _ = make(tmp_path)
    before = {step: lifecycle.validate(store, "r", step) for step in (1, 2)}
    report = lifecycle.scrub(brownout(store), older_than_s=0)
    assert report.checked == 0 and report.corrupt == [] and len(report.unreadable) == 2
    assert "SlowDown" in report.unreadable[0]
    for step in (1, 2):
        assert lifecycle.read_record(store, subject(store, step), "validation") == before[step]
    after = lifecycle.scrub(store, older_than_s=0)  # the store answers again
    assert after.checked == 2 and not after.corrupt and not after.unreadable


def test_cli_verify_says_the_store_is_unavailable_not_corrupt(tmp_path, capsys, monkeypatch):
    root, _, _ = make_store(tmp_path)
    monkeypatch.setattr("ckptflow.cli.commands.open_existing", lambda url: brownout(open_store(url, create=False)))
    code, out, err = run_cli(capsys, "verify", root, "--run", CLI_RUN, "--all")
    assert code == 3 and "SlowDown" in out and "none of them proof of damage" in err and "retry" in err
    flip_byte(chunk_path(root, only_in(root, CLI_RUN, 20, 10)[0]))
    monkeypatch.undo()
    assert run_cli(capsys, "verify", root, "--run", CLI_RUN, "--all")[0] == 1  # damage: the corrupt status


def test_a_missing_chunk_is_damage_and_a_denied_record_is_not(tmp_path):
    store, root = make(tmp_path)
    chunk_path(root, only_in(root, "r", 2, 1)[0]).unlink()
    assert catalog.verify_checkpoint(store, "r", 2).damaged
    flaky = FaultyStore(store)
    key = catalog.read_manifest(store, "r", 1).rank_key(0)

    def denied(op: str, k: str) -> bool:
        if k == key:
            raise PermissionError(13, "Permission denied", k)
        return False

    flaky.fail_if = denied
    report = catalog.verify_checkpoint(flaky, "r", 1)
    assert report.unavailable and "Permission denied" in report.problems[0]
    with pytest.raises(StoreUnavailableError, match="Permission denied"):
        lifecycle.validate(flaky, "r", 1)


def test_a_verdict_larger_than_any_record_is_refused_unread(tmp_path, monkeypatch):
    """A verdict is a few KB; one over ``SMALL_RECORD_BYTES`` is damage, refused from its size
    by ``read_record`` and by the verdict index alike. Both read it whole (the index took 1.2 GB
    of RSS for a 300 MB verdict) and trusted what it said."""
    store, _ = make(tmp_path)
    key = record_key(subject(store, 1), "validation")
    store.replace(key, b'{"ok": true, "pad": "' + b"x" * SMALL_RECORD_BYTES + b'"}')
    whole = store.get
    monkeypatch.setattr(store, "get", lambda k: pytest.fail(f"{k} was read whole") if k == key else whole(k))
    assert lifecycle.read_record(store, subject(store, 1), "validation") is None
    assert not any(s[1] == 1 for s in records_by_subject(store, "r"))
