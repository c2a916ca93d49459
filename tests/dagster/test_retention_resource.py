"""The retention policy is one resource (``CKPTFLOW_RETENTION``): a file that says something
else than a policy stops the code location loading, with what is wrong and what it takes."""

import json
import os
import threading

import pytest

from ckptflow.errors import CkptflowError
from ckptflow.policy.retention import KeepBestK, KeepRecent
from resources import RetentionResource
from resources.retention import MAX_POLICY_BYTES
from support.config_files import capped_python, load_error_from_unwritten_fifo


def from_file(tmp_path, monkeypatch, text: str) -> RetentionResource:
    path = tmp_path / "retention.json"
    path.write_text(text)
    monkeypatch.setenv("CKPTFLOW_RETENTION", str(path))
    return RetentionResource.from_env()


def test_the_policy_comes_from_the_file_ckptflow_retention_names(tmp_path, monkeypatch):
    retention = from_file(tmp_path, monkeypatch, json.dumps({"recent_days": 2, "best_k": 5, "pinned": ["r@10"]}))
    assert (retention.recent_days, retention.best_k, retention.full_days) == (2, 5, 30)  # the rest: defaults
    assert retention.refs() == [("r", 10)]
    rules = retention.policy().rules
    assert KeepRecent(2) in rules and KeepBestK("val_loss", 5, "min") in rules
    monkeypatch.delenv("CKPTFLOW_RETENTION")
    assert RetentionResource.from_env() == RetentionResource()


@pytest.mark.parametrize(
    "text, named",
    [
        ('{"recent_dayz": 2}', "fields retention does not have: \\['recent_dayz'\\]"),
        ('{"best_k": 2, "mode": "median"}', "mode must be 'min' or 'max'"),
        ('{"pinned": ["not a checkpoint"]}', "not a checkpoint"),
        ('{"recent_days": "a week"}', "recent_days: Input should be a valid number"),
        ('{"gc_grace": "one hour"}', "gc_grace: duration 'one hour' is not understood"),
        ('{"gc_wait": "a minute"}', "gc_wait: duration 'a minute' is not understood"),
        ('{"gc_wait": "11m"}', "gc_wait: '11m' is not from 0 to 600s, the longest a save"),
        ('{"gc_wait": "-1s"}', "gc_wait: '-1s' is not from 0 to 600s"),
        ('{"best_k": -2}', "best_k: Input should be greater than or equal to 0"),
        ('{"archive_partitions": -1}', "archive_partitions: Input should be greater than or equal to 0"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ("{", "it is not JSON \\(Expecting"),
        ("", "it is not JSON \\(Expecting value: line 1 column 1"),  # said only json's words: an empty file
    ],
)
def test_a_file_that_is_not_a_policy_is_refused_naming_what_is_wrong(tmp_path, monkeypatch, text, named):
    with pytest.raises(CkptflowError, match=f"CKPTFLOW_RETENTION=.*{named}.*JSON file of retention fields"):
        from_file(tmp_path, monkeypatch, text)


def test_a_file_nested_too_deeply_for_json_is_refused_as_the_price_file_is(tmp_path, monkeypatch):
    """100,000 '[' (100 KB, within the bound) raised RecursionError out of the code
    location's load, a traceback from inside ``json``, where ``CKPTFLOW_PRICES`` naming the
    same file said what is wrong: the two files are read by one rule."""
    with pytest.raises(CkptflowError, match="CKPTFLOW_RETENTION=.*: its JSON is nested too deeply; .*JSON file of"):
        from_file(tmp_path, monkeypatch, "[" * 100_000)


def test_a_missing_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTFLOW_RETENTION", str(tmp_path / "nowhere.json"))
    with pytest.raises(CkptflowError, match="nowhere.json.*No such file"):
        RetentionResource.from_env()


def test_ckptflow_retention_dev_zero_is_refused_at_once_with_what_to_do():
    """``CKPTFLOW_RETENTION=/dev/zero`` was read without end when the code location loaded
    (``CKPTFLOW_PRICES``, read the same way, was bounded; this one was not)."""
    code = "from resources import RetentionResource; RetentionResource.from_env()"
    done = capped_python(code, CKPTFLOW_RETENTION="/dev/zero")
    assert done.returncode == 1 and "MemoryError" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"CKPTFLOW_RETENTION=/dev/zero: it holds more than {MAX_POLICY_BYTES} bytes" in last, last


def test_ckptflow_retention_naming_a_fifo_no_process_writes_stops_the_load_with_why(tmp_path, monkeypatch):
    fifo, error = load_error_from_unwritten_fifo(
        tmp_path, monkeypatch, "CKPTFLOW_RETENTION", RetentionResource.from_env
    )
    assert isinstance(error, CkptflowError), error
    assert f"CKPTFLOW_RETENTION={fifo}: it was not read to its end within 0.5 s" in str(error), error


def test_ckptflow_retention_may_name_a_pipe(tmp_path, monkeypatch):
    fifo = tmp_path / "retention.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text('{"best_k": 7}'), daemon=True)
    writer.start()
    monkeypatch.setenv("CKPTFLOW_RETENTION", str(fifo))
    assert RetentionResource.from_env().best_k == 7
    writer.join(10)
