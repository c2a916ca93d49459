"""Model registry in the store: versions with lineage, and aliases that move.

Layout under the store root::

    registry/models/<model>/versions/<version:06d>.json   create-only: a version never changes
    registry/models/<model>/versions/<version:06d>/model.safetensors   the exported weights (optional)
    registry/models/<model>/aliases.json                  {"latest": 3, "stable": 2, "fallback": 1}

Versions are written with ``put_if_absent``, so two promotions racing for the same
number cannot both win (the loser takes the next number). Aliases are one small record
replaced atomically, so a reader sees the old or the new set, never a mix.

Every version names where it came from (run, step, checkpoint partition key, manifest
digest, training config, data description): the lineage from a deployed model back to
the exact bytes it was exported from. Retention never deletes a checkpoint that a
version was published from or an alias points to (``pinned`` / ``aliased``).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptflow import format as fmt
from ckptflow.errors import ObjectNotFoundError, RegistryError
from ckptflow.store.base import Store

PREFIX = "registry/models/"
ALIASES = ("latest", "stable", "fallback")
_VERSION = re.compile(r"^(\d{6})\.json$")


@dataclass(frozen=True)
class ModelVersion:
    model: str
    version: int
    run: str
    step: int
    partition_key: str
    manifest_digest: str
    artifact: dict  # {"store_key": ...} (in this store) or {"path": ...} (a local file)
    training_config: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)  # description of the training / evaluation data
    metrics: dict = field(default_factory=dict)
    dtype: str | None = None
    created_at: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


class Registry:
    def __init__(self, store: Store):
        self.store = store

    # ---- keys ------------------------------------------------------------------------
    def _model_prefix(self, model: str) -> str:
        return f"{PREFIX}{fmt.validate_run(model)}/"

    def version_key(self, model: str, version: int) -> str:
        return f"{self._model_prefix(model)}versions/{version:06d}.json"

    def artifact_key(self, model: str, version: int, name: str = "model.safetensors") -> str:
        return f"{self._model_prefix(model)}versions/{version:06d}/{name}"

    def _aliases_key(self, model: str) -> str:
        return f"{self._model_prefix(model)}aliases.json"

    # ---- reads -----------------------------------------------------------------------
    def models(self) -> list[str]:
        return [
            i.key[len(PREFIX) :].rstrip("/") for i in self.store.list(PREFIX, recursive=False) if i.key.endswith("/")
        ]

    def versions(self, model: str) -> list[ModelVersion]:
        out = []
        for info in self.store.list(f"{self._model_prefix(model)}versions/", recursive=False):
            if _VERSION.match(info.key.rsplit("/", 1)[-1]):
                out.append(ModelVersion(**json.loads(self.store.get(info.key))))
        return sorted(out, key=lambda v: v.version)

    def get(self, model: str, version: int) -> ModelVersion:
        try:
            return ModelVersion(**json.loads(self.store.get(self.version_key(model, version))))
        except ObjectNotFoundError:
            raise RegistryError(f"model {model!r} has no version {version} in {self.store.url}") from None

    def aliases(self, model: str) -> dict[str, int]:
        try:
            return json.loads(self.store.get(self._aliases_key(model)))
        except ObjectNotFoundError:
            return {}

    def resolve(self, model: str, alias: str) -> ModelVersion:
        aliases = self.aliases(model)
        if alias not in aliases:
            raise RegistryError(f"model {model!r} has no alias {alias!r} (it has {sorted(aliases)})")
        return self.get(model, aliases[alias])

    # ---- writes ----------------------------------------------------------------------
    def upload_artifact(self, model: str, version: int, data: bytes, name: str = "model.safetensors") -> str:
        key = self.artifact_key(model, version, name)
        self.store.put_if_absent(key, data)
        return key

    def register(
        self,
        model: str,
        *,
        run: str,
        step: int,
        manifest_digest: str,
        artifact: dict | None = None,
        artifact_bytes: bytes | None = None,
        training_config: dict | None = None,
        data: dict | None = None,
        metrics: dict | None = None,
        dtype: str | None = None,
        move_latest: bool = True,
    ) -> ModelVersion:
        """Create the next version (create-only) and, by default, point ``latest`` at it.

        ``artifact_bytes`` uploads the weights into the store next to the version;
        otherwise ``artifact`` names where they are.
        """
        existing = [v.version for v in self.versions(model)]
        version = (max(existing) if existing else 0) + 1
        for _ in range(100):
            if artifact_bytes is not None:
                artifact = {"store_key": self.upload_artifact(model, version, artifact_bytes)}
            mv = ModelVersion(
                model=model,
                version=version,
                run=run,
                step=step,
                partition_key=fmt.checkpoint_name(run, step),
                manifest_digest=manifest_digest,
                artifact=dict(artifact or {}),
                training_config=dict(training_config or {}),
                data=dict(data or {}),
                metrics=dict(metrics or {}),
                dtype=dtype,
                created_at=time.time(),
            )
            if self.store.put_if_absent(
                self.version_key(model, version), json.dumps(mv.to_json(), sort_keys=True).encode()
            ):
                break
            version += 1  # another promotion took this number
        else:
            raise RegistryError(f"could not claim a version number for model {model!r}")
        if move_latest:
            self.set_alias(model, "latest", version)
        return mv

    def set_alias(self, model: str, alias: str, version: int) -> dict[str, int]:
        if alias not in ALIASES:
            raise RegistryError(f"alias {alias!r} is not one of {ALIASES}")
        self.get(model, version)  # must exist
        aliases = {**self.aliases(model), alias: version}
        self.store.replace(self._aliases_key(model), json.dumps(aliases, sort_keys=True).encode())
        return aliases

    def promote(self, model: str, version: int) -> dict[str, int]:
        """Make ``version`` stable; the previous stable becomes the fallback."""
        self.get(model, version)
        aliases = dict(self.aliases(model))
        old = aliases.get("stable")
        if old == version:
            return aliases
        if old is not None:
            aliases["fallback"] = old
        aliases["stable"] = version
        self.store.replace(self._aliases_key(model), json.dumps(aliases, sort_keys=True).encode())
        return aliases

    def rollback(self, model: str) -> dict[str, int]:
        """stable <- fallback. The rolled-back version becomes the fallback, so a second
        rollback undoes the first."""
        aliases = dict(self.aliases(model))
        if "fallback" not in aliases:
            raise RegistryError(f"model {model!r} has no fallback to roll back to (aliases: {aliases})")
        aliases["stable"], aliases["fallback"] = aliases["fallback"], aliases.get("stable", aliases["fallback"])
        self.store.replace(self._aliases_key(model), json.dumps(aliases, sort_keys=True).encode())
        return aliases

    # ---- what retention must keep ------------------------------------------------------
    def pinned(self) -> set[tuple[str, int]]:
        """Checkpoints any version was published from."""
        return {(v.run, v.step) for m in self.models() for v in self.versions(m)}

    def aliased(self) -> dict[tuple[str, int], list[str]]:
        """Checkpoints an alias points to, with ``model:alias`` names."""
        out: dict[tuple[str, int], list[str]] = {}
        for m in self.models():
            for alias, version in self.aliases(m).items():
                v = self.get(m, version)
                out.setdefault((v.run, v.step), []).append(f"{m}:{alias}")
        return out


def describe(v: ModelVersion) -> dict[str, Any]:
    """Flat lineage fields for display."""
    return {
        "model": v.model,
        "version": v.version,
        "partition_key": v.partition_key,
        "run": v.run,
        "step": v.step,
        "manifest_digest": v.manifest_digest,
        "artifact": v.artifact.get("store_key") or v.artifact.get("path"),
        "dtype": v.dtype or "as saved",
    }
