"""Sealed records: the checksum is checked over the bytes as sealed, or over their canonical
form when the file was reformatted; any changed byte is caught either way."""

from __future__ import annotations

import hashlib
import json

import pytest

from ckptflow.errors import ManifestError
from ckptflow.format import layout as fmt
from ckptflow.format.sealed import MAX_DEPTH, canonical, seal, unseal

RECORD = {
    "format_version": fmt.FORMAT_VERSION,
    "run": "run-é",  # escaped as \u00e9 by the canonical form
    "quote": 'a "quoted" \\ back\nslash',
    "numbers": [0, -1, 1.5, 1e300, float("nan")],
    "nested": {"checksum": "not the seal's", "empty": {}, "list": [[], [{}]]},
}


def _same(a, b) -> bool:
    return json.dumps(a, allow_nan=True) == json.dumps(b, allow_nan=True)  # NaN != NaN as a value


def test_a_sealed_record_reads_back_as_written():
    assert _same(unseal(seal(RECORD), "record"), RECORD)


@pytest.mark.parametrize("record", [RECORD, {}, {"checksum": "replaced"}], ids=["record", "empty", "only-checksum"])
def test_the_sealed_bytes_are_the_canonical_json_of_the_record_and_its_checksum(record):
    """What readers that re-encode the record (older ckptflow) check, byte for byte."""
    body = {k: v for k, v in record.items() if k != "checksum"}
    expected = canonical({**body, "checksum": hashlib.sha256(canonical(body)).hexdigest()})
    assert seal(record) == expected


def test_a_reformatted_record_is_accepted_by_its_canonical_form():
    blob = json.dumps(json.loads(seal(RECORD)), indent=2, ensure_ascii=False).encode()
    assert _same(unseal(blob, "record"), RECORD)


def test_every_single_byte_change_is_caught():
    blob = seal(RECORD)
    body_end = blob.rindex(b',"checksum":')
    for pos in range(body_end):  # the body; a change in the checksum itself is a mismatch too
        changed = bytearray(blob)
        changed[pos] ^= 0x01
        with pytest.raises(ManifestError):
            unseal(bytes(changed), "record")


def test_a_changed_value_under_a_reformatted_layout_is_caught():
    record = json.loads(seal(RECORD))
    record["run"] = "forged"
    with pytest.raises(ManifestError, match="checksum"):
        unseal(json.dumps(record, indent=1).encode(), "record")


def test_nesting_deeper_than_the_limit_is_refused():
    deep: dict = {"format_version": fmt.FORMAT_VERSION}
    node = deep
    for _ in range(MAX_DEPTH):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ManifestError, match="nested deeper"):
        unseal(seal(deep), "record")
    shallow = {"format_version": fmt.FORMAT_VERSION, "x": [[[]]]}
    assert unseal(seal(shallow), "record")["x"] == [[[]]]


@pytest.mark.parametrize("claimed", ["", None, 0, "\ud800"], ids=["empty", "null", "zero", "lone-surrogate"])
def test_a_checksum_field_that_is_no_checksum_is_refused(claimed):
    blob = json.dumps({"format_version": fmt.FORMAT_VERSION, "checksum": claimed}).encode()
    with pytest.raises(ManifestError, match="checksum"):
        unseal(blob, "record")


def test_a_checksum_damaged_past_its_first_characters_shows_where_the_two_differ():
    """Both digests were cut to 12 characters: "stored 4cc2936304b7…, computed 4cc2936304b7…"."""
    sealed = seal(RECORD)
    record = json.loads(sealed)
    claimed = record["checksum"]
    damaged = claimed[:40] + ("0" if claimed[40] != "0" else "1") + claimed[41:]
    with pytest.raises(ManifestError) as err:
        unseal(sealed.replace(claimed.encode(), damaged.encode()), "record")
    assert f"stored {damaged}, computed {claimed}" in str(err.value)
