"""Store layout, names, and the JSON records that make a checkpoint exist.

Layout (relative to the store root)::

    chunks/<aa>/<sha256>                                   encoded chunk (codecs.py)
    runs/<run>/checkpoints/<step:012d>/ranks/<rank>.json   rank record
    runs/<run>/checkpoints/<step:012d>/manifest.json       commit record, written last

Every JSON record carries ``checksum``: the sha256 of its canonical JSON without that
field, so a flipped byte anywhere in a record is detected before it is trusted.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from ckptflow.errors import InvalidNameError, ManifestError

FORMAT_VERSION = 1
STEP_DIGITS = 12
_RUN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_run(run: str) -> str:
    if not isinstance(run, str) or not _RUN.match(run) or ".." in run or "__" in run:
        raise InvalidNameError(
            f"run name {run!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..' or '__' (e.g. 'gpt-small-001')"
        )
    return run


def validate_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**STEP_DIGITS:
        raise InvalidNameError(f"step {step!r} must be an integer in [0, 10**{STEP_DIGITS})")
    return step


def chunk_key(digest: str) -> str:
    return f"chunks/{digest[:2]}/{digest}"


def runs_prefix() -> str:
    return "runs/"


def checkpoints_prefix(run: str) -> str:
    return f"runs/{validate_run(run)}/checkpoints/"


def step_prefix(run: str, step: int) -> str:
    return f"{checkpoints_prefix(run)}{validate_step(step):0{STEP_DIGITS}d}/"


def manifest_key(run: str, step: int) -> str:
    return step_prefix(run, step) + "manifest.json"


def rank_key(run: str, step: int, rank: int) -> str:
    return f"{step_prefix(run, step)}ranks/{int(rank)}.json"


def quarantine_key(run: str, step: int, stamp: str) -> str:
    return f"runs/{validate_run(run)}/quarantine/{validate_step(step):0{STEP_DIGITS}d}-{stamp}.json"


def parse_step_dir(name: str) -> int | None:
    name = name.rstrip("/").rsplit("/", 1)[-1]
    return int(name) if len(name) == STEP_DIGITS and name.isdigit() else None


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def seal(record: dict) -> bytes:
    """Serialize ``record`` with its own checksum."""
    body = {k: v for k, v in record.items() if k != "checksum"}
    return canonical({**body, "checksum": hashlib.sha256(canonical(body)).hexdigest()})


def unseal(blob: bytes, where: str) -> dict:
    """Parse and verify a sealed record; ``ManifestError`` naming ``where`` otherwise."""
    try:
        record = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{where} is not valid JSON ({e}); the record is corrupt") from None
    if not isinstance(record, dict) or "checksum" not in record:
        raise ManifestError(f"{where} has no checksum field; it is not a ckptflow record")
    claimed = record.pop("checksum")
    actual = hashlib.sha256(canonical(record)).hexdigest()
    if claimed != actual:
        raise ManifestError(f"{where} fails its checksum (stored {str(claimed)[:12]}…, computed {actual[:12]}…)")
    if record.get("format_version") != FORMAT_VERSION:
        raise ManifestError(
            f"{where} has format_version {record.get('format_version')!r}; this ckptflow reads "
            f"{FORMAT_VERSION}: upgrade ckptflow to read it"
        )
    return record


def digest_of(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()
