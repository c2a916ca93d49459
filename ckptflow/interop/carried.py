"""The marks an export carries that its import must not lose: the ``lossy`` record of a
lossy archive copy, and the failed validation verdict an export was made despite
(``allow_failed``).

Each travels where the export writes it: a DCP export's ``ckptflow.json`` (``lossy``,
``failed_validation``), the header of every safetensors file (``LOSSY_KEY``, ``FAILED_KEY``)
and a model directory's config.json (``LOSSY_CONFIG_KEY``, ``FAILED_CONFIG_KEY``), which
outlives the header: transformers' ``save_pretrained`` of a loaded export keeps the
config's keys and writes a header of its own. So a safetensors file imported on its own is
read with the config.json beside it too: the file a re-save wrote carries nothing else. A
directory whose header and config.json name different records is refused: which copy the
weights are is unknown.

An import commits a ``lossy`` record again (the new checkpoint restores only with
``allow_lossy``). A failed verdict refuses the import unless it is asked for
(``allow_failed``); then the new commit carries it (``importers.import_checkpoint``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from safetensors import SafetensorError, safe_open

from ckptflow.chunks import lossy as lossy_codecs
from ckptflow.errors import CkptflowError
from ckptflow.format.sealed import json_problem
from ckptflow.interop.export.dcp import SIDECAR
from ckptflow.interop.export.files import FAILED_CONFIG_KEY, FAILED_KEY, LOSSY_CONFIG_KEY, LOSSY_KEY, weight_files
from ckptflow.interop.source_files import MAX_JSON_BYTES, check_regular_file, read_json_file

NOTHING = object()  # an export that carries no such mark (None would be a JSON null)


def carried_lossy(src: str, format: str) -> dict | None:
    """The ``lossy`` record an export of a lossy archive copy carries, or None."""
    found = _carried(
        src, format, sidecar_key="lossy", header_key=LOSSY_KEY, config_key=LOSSY_CONFIG_KEY, what="lossy copies"
    )
    if found is NOTHING:
        return None
    problem = lossy_codecs.record_problem(found)
    if problem:
        raise CkptflowError(
            f"{src} says it was exported from a lossy archive copy, but its record is malformed ({problem}); "
            "refused, since the checkpoint would lose that mark"
        )
    return found


def carried_failed_validation(src: str, format: str) -> dict | None:
    """The failed validation verdict an export was made despite (``allow_failed``), or None."""
    found = _carried(
        src,
        format,
        sidecar_key="failed_validation",
        header_key=FAILED_KEY,
        config_key=FAILED_CONFIG_KEY,
        what="failed validation verdicts",
    )
    if found is NOTHING:
        return None
    problem = _verdict_problem(found)
    if problem:
        raise CkptflowError(
            f"{src} says it was exported despite a failed validation, but the verdict it carries is malformed "
            f"({problem}); refused, since the checkpoint would lose that mark"
        )
    return found


def _verdict_problem(verdict: Any) -> str | None:
    if not isinstance(verdict, dict):
        return f"a JSON {'null' if verdict is None else type(verdict).__name__}, not an object"
    problems = verdict.get("problems", [])
    if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
        return "its 'problems' is not a list of strings"
    return json_problem(verdict, "the verdict")


def _carried(src: str, format: str, *, sidecar_key: str, header_key: str, config_key: str, what: str) -> Any:
    """The value the export at ``src`` carries under these keys (``NOTHING``: none; a key
    there with a null value is a value, refused by the caller: a mark edited to null must not
    read as no mark); ``what`` names such values in an error."""
    found: Any = NOTHING
    header = ""  # the file whose header carried it
    if format == "dcp" and os.path.isfile(os.path.join(src, SIDECAR)):
        doc = read_json_file(os.path.join(src, SIDECAR), limit=MAX_JSON_BYTES)
        found = doc.get(sidecar_key, NOTHING) if isinstance(doc, dict) else NOTHING
    elif format in ("safetensors", "hf"):
        for path in [src] if format == "safetensors" else weight_files(src)[0]:
            check_regular_file(path)
            try:
                with safe_open(path, "pt") as f:
                    text = (f.metadata() or {}).get(header_key)
            except (OSError, ValueError, SafetensorError) as e:
                raise CkptflowError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
            if text is not None:
                header = path
                try:
                    found = json.loads(text)
                except (ValueError, RecursionError):
                    found = text  # refused by the caller as not an object
                break
    if format in ("hf", "safetensors"):  # a file's directory: the model directory it may be the weights of
        directory = src if format == "hf" else os.path.dirname(src)
        found = _in_config(directory, found, header, header_key=header_key, config_key=config_key, what=what)
    return found


def _in_config(src: str, found: Any, header: str, *, header_key: str, config_key: str, what: str) -> Any:
    """The record of model directory ``src`` (a safetensors file's own directory): its
    config.json's as well as a header's (``found``, from ``header``); two that differ are refused."""
    path = os.path.join(src, "config.json")
    config = read_json_file(path, limit=MAX_JSON_BYTES) if os.path.isfile(path) else None
    in_config = config.get(config_key, NOTHING) if isinstance(config, dict) else NOTHING
    if in_config is NOTHING:
        return found
    if found is not NOTHING and found != in_config:
        raise CkptflowError(
            f"{path} and {header} name different {what} ({config_key} "
            f"{json.dumps(in_config, sort_keys=True)[:300]}, {header_key} {json.dumps(found, sort_keys=True)[:300]}): "
            "one of them was edited, so which copy the weights are is unknown; refused. Export the copy again"
        )
    return in_config
