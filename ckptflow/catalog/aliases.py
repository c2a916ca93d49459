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

from ckptflow.errors import ObjectNotFoundError, RegistryError
from ckptflow.format import layout as fmt
from ckptflow.store.base import Store

PREFIX = "registry/models/"
ALIASES = ("latest", "stable", "fallback")


def model_prefix(model: str) -> str:
    return f"{PREFIX}{fmt.validate_run(model)}/"


def version_key(model: str, version: int) -> str:
    return f"{model_prefix(model)}versions/{version:06d}.json"


def aliases_key(model: str) -> str:
    return f"{model_prefix(model)}aliases.json"


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
        blob = store.get(key)
    except ObjectNotFoundError:
        return {}
    return dict(parse_aliases(blob, f"{store.url}/{key}")["aliases"])


def read_version(store: Store, model: str, version: int) -> dict[str, Any]:
    """The JSON record of one model version (``RegistryError`` if there is none)."""
    key = version_key(model, version)
    try:
        doc = json.loads(store.get(key))
    except ObjectNotFoundError:
        raise RegistryError(f"model {model!r} has no version {version} in {store.url}") from None
    except (ValueError, RecursionError) as e:
        raise RegistryError(f"{store.url}/{key} is not JSON ({e}): the version record is damaged") from None
    if not isinstance(doc, dict):
        raise RegistryError(f"{store.url}/{key} is not a version record")
    return doc
