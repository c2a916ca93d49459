"""A run's lineage to its data and configuration, as every checkpoint records it.

A run declares once what it trains on (``RunLineage``: its training config, any JSON, and
its datasets, each a URI plus a version or a content digest); the ``Checkpointer`` writes
it into every checkpoint's metadata under ``config`` and ``data``, the two keys the model
card and the registry's model versions already read (``ckptflow.interop.export.card``),
so a promotion carries it to the deployed model. A resume that declares something else
than the checkpoint it loads is told what differs (``differences``). Pure: no store.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptflow.errors import UnsupportedStateError
from ckptflow.format.sealed import json_problem

CONFIG, DATA = "config", "data"  # metadata keys


class LineageMismatchWarning(UserWarning):
    """A resume declares other data or config than the checkpoint it loaded recorded."""


@dataclass(frozen=True)
class Dataset:
    """One dataset a run reads: where (``uri``) and which (a ``version``, a content ``digest``, or both)."""

    uri: str
    version: str | None = None
    digest: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or not self.uri:
            raise ValueError(f"Dataset(uri=...) must name where the data is, got {self.uri!r}")
        if self.version is None and self.digest is None:
            raise ValueError(f"Dataset {self.uri!r} needs a version or a content digest: which data, not only where")

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in (("uri", self.uri), ("version", self.version), ("digest", self.digest)) if v}


@dataclass(frozen=True)
class RunLineage:
    """What a run trains on: ``config`` (any JSON object) and ``datasets``."""

    config: Mapping[str, Any] = field(default_factory=dict)
    datasets: Sequence[Dataset] = ()

    def __post_init__(self) -> None:
        problem = json_problem(dict(self.config), "lineage config")
        if problem:
            raise UnsupportedStateError(f"{problem}: the training config is recorded as JSON")
        uris = [d.uri for d in self.datasets]
        if len(set(uris)) != len(uris):
            raise ValueError(f"RunLineage names a dataset twice: {sorted(uris)}")

    def metadata(self) -> dict[str, Any]:
        """The metadata entries every checkpoint of the run records."""
        return {CONFIG: json.loads(json.dumps(dict(self.config))), DATA: [d.to_json() for d in self.datasets]}

    def merged(self, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
        """``metadata`` with the lineage added; a save's own ``config`` / ``data`` that says
        otherwise is refused (one run, one declared lineage)."""
        own = self.metadata()
        out = dict(metadata or {})
        for key, value in own.items():
            if key in out and out[key] != value:
                raise UnsupportedStateError(
                    f"save(metadata={{{key!r}: ...}}) differs from the run's declared lineage ({key}: {value!r}); "
                    "drop it from the save's metadata or declare the new lineage on the Checkpointer"
                )
            out[key] = value
        return out


def differences(declared: RunLineage, metadata: Mapping[str, Any]) -> list[str]:
    """How ``declared`` differs from what a checkpoint recorded (its metadata), one line each."""
    out = []
    saved_config = metadata.get(CONFIG)
    saved_config = saved_config if isinstance(saved_config, Mapping) else {}
    now = declared.metadata()[CONFIG]
    for key in sorted(set(saved_config) | set(now)):
        if saved_config.get(key, "<absent>") != now.get(key, "<absent>"):
            was, is_ = saved_config.get(key, "<absent>"), now.get(key, "<absent>")
            out.append(f"config {key!r}: checkpoint {was!r}, now {is_!r}")
    saved_data = metadata.get(DATA)
    saved = {d.get("uri"): d for d in saved_data if isinstance(d, Mapping)} if isinstance(saved_data, list) else {}
    current = {d.uri: d.to_json() for d in declared.datasets}
    for uri in sorted(set(saved) | set(current), key=str):
        if uri not in current:
            out.append(f"dataset {uri}: in the checkpoint, not declared now")
        elif uri not in saved:
            out.append(f"dataset {uri}: declared now, not in the checkpoint")
        elif dict(saved[uri]) != current[uri]:
            was = ", ".join(f"{k} {v}" for k, v in sorted(saved[uri].items()) if k != "uri")
            now_ = ", ".join(f"{k} {v}" for k, v in sorted(current[uri].items()) if k != "uri")
            out.append(f"dataset {uri}: checkpoint {was}, now {now_}")
    return out


def warn_if_different(declared: RunLineage, metadata: Mapping[str, Any], what: str) -> list[str]:
    """Warn (``LineageMismatchWarning``) naming each way ``declared`` differs from what a
    loaded checkpoint recorded; ``what`` says which load (run and step). Returns them."""
    found = differences(declared, metadata)
    if found:
        warnings.warn(
            LineageMismatchWarning(
                f"{what}, which was trained on other data or config than this run declares: {'; '.join(found)}"
            ),
            stacklevel=4,
        )
    return found
