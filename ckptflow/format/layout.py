"""Store layout: the names of the objects that make a checkpoint exist.

Layout (relative to the store root)::

    chunks/<aa>/<address>                                      encoded chunk (codecs.py; address: checksum.py)
    runs/<run>/checkpoints/<step:012d>/ranks/<rank>.<id>.json  rank record of the save attempt <id> (rank_key)
    runs/<run>/checkpoints/<step:012d>/manifest.json           commit record, written last
    runs/<run>/quarantine/<step:012d>-<digest>.json            a manifest moved aside (quarantine.py)
    locks/runs/<run>                                           the run's lock (commit.py; not an object)

Checkpoints written before rank records were named by the save attempt have
``ranks/<rank>.json``; their manifest lacks ``rank_records`` (``Manifest.rank_key``).
Every JSON record carries ``checksum`` (``sealed.seal``): the sha256 of its canonical
JSON without that field, so a flipped byte anywhere in a record is detected before it is
trusted. This module holds names only; it imports neither torch nor any backend.
"""

from __future__ import annotations

import hashlib
import operator
import re

from ckptflow.errors import InvalidNameError

FORMAT_VERSION = 2  # what this ckptflow writes; 2: chunks addressed by BLAKE3 (``checksum``)
PACKED_FORMAT = 3  # a manifest with packs (``ckptflow.dcp.packs``): a reader without them says to upgrade
MAX_PACK_BYTES = 64 << 20  # no pack is larger: a reader allocates a whole pack to restore one member of it
READABLE_FORMATS = (1, 2, 3)
STEP_DIGITS = 12
IMPORT_FORMATS = ("dcp", "safetensors", "hf", "torch")  # what `ckptflow import` reads (ckptflow.interop.importers)
DIGEST_HEX = 64  # hex digits of every digest: chunk addresses (BLAKE3 or sha256) and manifests (sha256)
_DIGEST = re.compile(f"[0-9a-f]{{{DIGEST_HEX}}}")
# bytes per element of every dtype a checkpoint may hold, by torch's name for it
DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}
FLOATING_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})  # byte planes rotate these
_RUN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


def validate_run(run: str) -> str:
    if not isinstance(run, str) or not _RUN.match(run) or ".." in run or "__" in run:
        raise InvalidNameError(
            f"run name {run!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..' or '__' (e.g. 'gpt-small-001')"
        )
    return run


def validate_step(step: int) -> int:
    """The step as a plain int (numpy and torch integer scalars are accepted)."""
    try:
        value = operator.index(step) if not isinstance(step, bool) else None
    except TypeError:
        value = None
    if value is None or not 0 <= value < 10**STEP_DIGITS:
        raise InvalidNameError(f"step {step!r} must be an integer in [0, 10**{STEP_DIGITS})")
    return value


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


def rank_key(run: str, step: int, rank: int, save_id: str = "") -> str:
    """Where ``rank``'s record of one save attempt goes. Named by the attempt's id, so two
    writers racing on one step never overwrite each other's records: the manifest that
    commits names its save id, and so its records. (Without ``save_id``: the name
    checkpoints written before that used; readers still find them.)"""
    return f"{step_prefix(run, step)}ranks/{int(rank)}{'.' + save_id if save_id else ''}.json"


def quarantine_key(run: str, step: int, digest: str) -> str:
    """Where a rejected manifest of ``step`` with sha256 ``digest`` is kept (``ckptflow.catalog.quarantine``)."""
    return f"runs/{validate_run(run)}/quarantine/{validate_step(step):0{STEP_DIGITS}d}-{digest}.json"


UNDECODABLE_PREFIX = "undecodable/"


def undecodable_key(digest: str, stored: str) -> str:
    """Where restore records that chunk object ``digest``, as stored (xxh3-128 ``stored``),
    holds its saver's bytes yet does not decode to its content (``ckptflow.chunks.reads``)."""
    return f"{UNDECODABLE_PREFIX}{digest}.{stored}.json"


DAMAGED_PREFIX = "damaged/"


def damaged_key(digest: str) -> str:
    """Where a reader records that the chunk object ``digest`` holds bytes that are not its
    content, until a save writes it anew (``ckptflow.chunks.damaged``)."""
    return f"{DAMAGED_PREFIX}{digest}.json"


def run_lock_key(run: str) -> str:
    """The lock a save holds while it decides whether a manifest already at its step may be
    replaced (``ckptflow.catalog.commit``); on a local store a hidden ``flock`` file, never an object."""
    return f"locks/runs/{validate_run(run)}"


NAME_SEP = "@"
LEGACY_NAME_SEP = "__step-"  # names before 2026-12: ``<run>__step-<12-digit step>``


def checkpoint_name(run: str, step: int) -> str:
    """``<run>@<step>`` (``gpt-small@1200``): one name per checkpoint, the Dagster partition
    key. Short, so the UI's partition axes, run lists and tags show it whole (the former
    ``<run>__step-<12-digit step>`` was cut there, and plotted as overlapping labels). Run
    names cannot contain ``@``, so the split is unambiguous; order by ``parse_checkpoint_name``,
    never by the string (``run@10`` sorts before ``run@9``)."""
    return f"{validate_run(run)}{NAME_SEP}{validate_step(step)}"


def legacy_checkpoint_name(run: str, step: int) -> str:
    """The name a Dagster instance from before 2026-12 may still hold the checkpoint's partition as."""
    return f"{validate_run(run)}{LEGACY_NAME_SEP}{validate_step(step):0{STEP_DIGITS}d}"


def parse_checkpoint_name(name: str) -> tuple[str, int]:
    """(run, step) of a checkpoint name: ``<run>@<step>`` (no leading zeros, so each
    checkpoint has one name), or the legacy ``<run>__step-<12-digit step>``."""
    run, sep, step = name.rpartition(NAME_SEP)
    if sep and 0 < len(step) <= STEP_DIGITS and step.isascii() and step.isdigit() and (step == "0" or step[0] != "0"):
        return validate_run(run), int(step)
    run, sep, step = name.rpartition(LEGACY_NAME_SEP)
    if sep and len(step) == STEP_DIGITS and step.isascii() and step.isdigit():
        return validate_run(run), int(step)
    raise InvalidNameError(
        f"checkpoint name {name!r} is not '<run>{NAME_SEP}<step>' (e.g. 'gpt-small{NAME_SEP}1200'), "
        f"nor the older '<run>{LEGACY_NAME_SEP}<{STEP_DIGITS}-digit step>'"
    )


def parse_step_dir(name: str) -> int | None:
    name = name.rstrip("/").rsplit("/", 1)[-1]
    return int(name) if len(name) == STEP_DIGITS and name.isdigit() else None


def is_digest(value: object) -> bool:
    """A 64-digit lower-case hex digest: what chunk keys, record keys and registry files are named by."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def digest_of(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()
