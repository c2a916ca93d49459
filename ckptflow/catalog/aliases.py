"""The registry's aliases as the catalog reads them: where a model's aliases and versions live.

The registry (``ckptflow.interop.registry``) writes these records; a training job that
restores "the stable model of this run" (``restore(select=Alias(...))``) only reads them.
The training path may not load the registry's export and upload code, so the layout and
the one read both need live here, below both, and the registry uses the same functions:
one rule for where an alias points, in one place.
"""

from __future__ import annotations

import json
from typing import Any

from ckptflow.errors import ObjectNotFoundError, ObjectTooLargeError, RegistryError
from ckptflow.format import layout as fmt
from ckptflow.store.base import Store

PREFIX = "registry/models/"
ALIASES = ("latest", "stable", "fallback")
MAX_RECORD_BYTES = 16 << 20  # an alias or version record: a few KB; more is damage, refused unread


def model_prefix(model: str) -> str:
    return f"{PREFIX}{fmt.validate_run(model)}/"


def version_key(model: str, version: int) -> str:
    return f"{model_prefix(model)}versions/{version:06d}.json"


def aliases_key(model: str) -> str:
    return f"{model_prefix(model)}aliases.json"


def read_bounded(store: Store, key: str) -> bytes:
    """A registry record's bytes, refused unread when larger than any such record."""
    try:
        return store.get_bounded(key, MAX_RECORD_BYTES)
    except ObjectTooLargeError:
        raise RegistryError(f"{store.url}/{key} is larger than any registry record: it is damaged") from None


def parse_aliases(blob: bytes, where: str) -> dict[str, Any]:
    """The alias document ``{"aliases": {alias: version}, "move": {...}}``, checked."""
    try:
        doc = json.loads(blob)
    except (ValueError, RecursionError) as e:
        raise RegistryError(f"{where} is not JSON ({e}): the registry's alias record is damaged") from None
    aliases = doc.get("aliases") if isinstance(doc, dict) else None
    if not isinstance(aliases, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in aliases.values()
    ):
        raise RegistryError(f"{where} has no {{alias: version}} map: the registry's alias record is damaged")
    return doc


def read_aliases(store: Store, model: str) -> dict[str, int]:
    """``{alias: version}`` of ``model`` ({} when it has none yet)."""
    key = aliases_key(model)
    try:
        blob = read_bounded(store, key)
    except ObjectNotFoundError:
        return {}
    return dict(parse_aliases(blob, f"{store.url}/{key}")["aliases"])


def read_version(store: Store, model: str, version: int) -> dict[str, Any]:
    """The JSON record of one model version (``RegistryError`` if there is none)."""
    key = version_key(model, version)
    try:
        doc = json.loads(read_bounded(store, key))
    except ObjectNotFoundError:
        raise RegistryError(f"model {model!r} has no version {version} in {store.url}") from None
    except (ValueError, RecursionError) as e:
        raise RegistryError(f"{store.url}/{key} is not JSON ({e}): the version record is damaged") from None
    problem = _version_problem(doc, model, version)
    if problem:
        raise RegistryError(f"{store.url}/{key} is not a version record of this layout: {problem}")
    return doc


def file_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be a file of a model version (None if it can): a download writes
    each file at ``directory/name``, so a path (``../x``, ``/etc/x``) would write outside it."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        return f"file name {name!r} is not a plain file name (a download writes it inside a model directory)"
    return None


def _version_problem(doc: Any, model: str, version: int) -> str | None:
    """What makes ``doc`` no record of ``model`` version ``version``: the fields retention,
    rollback and restore rely on must have their types (a step "1" is not step 1)."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get("model") != model or doc.get("version") != version or type(doc.get("version")) is not int:
        return f"it names {doc.get('model')!r} version {doc.get('version')!r}"
    step, files = doc.get("step"), doc.get("files")
    if not isinstance(doc.get("run"), str) or type(step) is not int or step < 0:
        return f"run {doc.get('run')!r} step {step!r} is not a run name and a step number"
    if not isinstance(doc.get("manifest_digest"), str) or not isinstance(doc.get("partition_key"), str):
        return "manifest_digest and partition_key must be strings"
    if not isinstance(files, dict) or not all(
        isinstance(f, dict) and isinstance(f.get("sha256"), str) and type(f.get("size")) is int for f in files.values()
    ):
        return "files must map each name to its sha256 and size"
    for name in files:
        if problem := file_name_problem(name):
            return problem
    return None
