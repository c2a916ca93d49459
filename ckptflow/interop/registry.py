"""Model registry in the store: versions with lineage, and aliases moved by compare-and-swap.

Layout under the store root::

    registry/models/<model>/files/<sha256>                exported files, content-addressed (immutable)
    registry/models/<model>/versions/<version:06d>.json   create-only: a version never changes
    registry/models/<model>/aliases.json                  {"aliases": {"latest": 3, "stable": 2,
                                                           "fallback": 1}, "move": {...}}

Three aliases: ``latest`` (the newest version, under evaluation), ``stable`` (in
production) and ``fallback`` (the previous stable, what a rollback returns to).

Why two promotions at once cannot mix up their weights: files are uploaded under their
own sha256 before the version record that names them exists, so a version can only
name bytes that hash to what it records; version numbers are claimed create-only (the
loser of a race takes the next number, its record naming its own files); and the alias
record is only ever replaced by compare-and-swap (``Store.replace_if``: If-Match on S3,
a lock and the content hash locally), each move recomputed from the aliases it read,
so a concurrent move is never overwritten with stale aliases. Each move carries an id,
so a write whose response was lost is recognised as ours on the retry.

Every version names where it came from (run, step, checkpoint partition key, manifest
digest, validation, evaluation, training config, data) and how it was exported, so the
files can be rebuilt from the checkpoint (``ckptflow.lifecycle.promote.rebuild``).
Retention never deletes the commit (manifest digest) that a version was published from
or an alias points to (``pinned`` / ``aliased``).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ckptflow.catalog import aliases as alias_records
from ckptflow.catalog.aliases import ALIASES, PREFIX
from ckptflow.errors import ObjectNotFoundError, ObjectTooLargeError, RegistryError
from ckptflow.format import layout as fmt
from ckptflow.interop import model_download
from ckptflow.store.base import Store

__all__ = ["ALIASES", "PREFIX", "ModelVersion", "Registry"]
_VERSION = re.compile(r"^(\d{6})\.json\Z")
CAS_ATTEMPTS = 200

Aliases = dict[str, int]


@dataclass(frozen=True)
class ModelVersion:
    model: str
    version: int
    run: str
    step: int
    partition_key: str
    manifest_digest: str
    files: dict[str, dict[str, Any]]  # file name -> {"sha256": ..., "size": ...}
    export: dict[str, Any] = field(default_factory=dict)  # ExportOptions: how the files were made
    lineage: dict[str, Any] = field(default_factory=dict)  # validation, evaluation, training config, data
    created_at: float = 0.0

    @property
    def dtype(self) -> str:
        return self.export.get("dtype") or "as saved"

    def to_json(self) -> dict:
        return asdict(self)


class Registry:
    def __init__(self, store: Store):
        self.store = store

    # ---- keys ------------------------------------------------------------------------
    def _model_prefix(self, model: str) -> str:
        return alias_records.model_prefix(model)

    def version_key(self, model: str, version: int) -> str:
        return alias_records.version_key(model, version)

    def file_key(self, model: str, sha256: str) -> str:
        if not fmt.is_digest(sha256):
            raise RegistryError(f"{sha256!r} is not a sha256 hex digest")
        return f"{self._model_prefix(model)}files/{sha256}"

    def _aliases_key(self, model: str) -> str:
        return alias_records.aliases_key(model)

    # ---- reads -----------------------------------------------------------------------
    def models(self) -> list[str]:
        return [
            i.key[len(PREFIX) :].rstrip("/") for i in self.store.list(PREFIX, recursive=False) if i.key.endswith("/")
        ]

    def versions(self, model: str) -> list[ModelVersion]:
        return [self.get(model, number) for number in self.version_numbers(model)]

    def version_numbers(self, model: str) -> list[int]:
        """The numbers claimed, from the records' names alone: claiming the next one needs
        no record read, so one damaged record does not block every later promotion."""
        listed = self.store.list(f"{self._model_prefix(model)}versions/", recursive=False)
        return sorted(int(m.group(1)) for info in listed if (m := _VERSION.match(info.key.rsplit("/", 1)[-1])))

    def get(self, model: str, version: int) -> ModelVersion:
        """The version's record, checked (``alias_records.read_version``); fields this
        ckptflow does not know (a newer one wrote them) are left out."""
        doc = alias_records.read_version(self.store, model, version)
        return ModelVersion(**{f.name: doc[f.name] for f in fields(ModelVersion) if f.name in doc})

    def _read_aliases(self, model: str) -> tuple[dict[str, Any], str | None]:
        key = self._aliases_key(model)
        try:
            blob, version = self.store.get_versioned(key, alias_records.MAX_RECORD_BYTES)
        except ObjectNotFoundError:
            return {"aliases": {}}, None
        except ObjectTooLargeError:
            raise RegistryError(f"{self.store.url}/{key} is larger than any registry record: it is damaged") from None
        return alias_records.parse_aliases(blob, f"{self.store.url}/{key}"), version

    def aliases(self, model: str) -> Aliases:
        return alias_records.read_aliases(self.store, model)

    def resolve(self, model: str, alias: str) -> ModelVersion:
        aliases = self.aliases(model)
        if alias not in aliases:
            raise RegistryError(f"model {model!r} has no alias {alias!r} (it has {sorted(aliases)})")
        return self.get(model, aliases[alias])

    def missing_files(self, version: ModelVersion) -> list[str]:
        """Names of the version's files whose bytes are not in the store (deleted)."""
        model = version.model
        return [n for n, f in sorted(version.files.items()) if not self.store.exists(self.file_key(model, f["sha256"]))]

    def download(self, version: ModelVersion, directory: str | os.PathLike) -> None:
        """The version's files into ``directory`` (a model directory), streamed, each checked
        against its recorded size (every one, before a byte is read) and sha256. Each is
        written under a temporary name first; only once every one is checked are they renamed
        into place, so a file that does not match (or a failed read) changes nothing in
        ``directory``: a served model is never left half replaced by the version meant to
        replace it (``ckptflow.interop.model_download``)."""
        key_of = lambda sha256: self.file_key(version.model, sha256)
        model_download.download(self.store, version.files, key_of, f"{version.model} v{version.version}", directory)

    # ---- writes ----------------------------------------------------------------------
    def upload(self, model: str, directory: str | os.PathLike, names: list[str]) -> dict[str, dict[str, Any]]:
        """Upload files of ``directory`` under their sha256, streamed: each is hashed in
        blocks, then handed to the store as a memory map (pages go from disk to the store,
        never a copy of the whole file in memory). Returns ``{name: {"sha256", "size"}}``.

        A file already stored under its sha256 is written again (an atomic replace with
        the same bytes): the object there may have rotted, and checking it would read as
        much as writing it; so each promotion (and ``rebuild``) heals what it names."""
        files = {}
        for name in names:
            path = os.path.join(directory, name)
            digest = sha256_file(path)
            size = os.path.getsize(path)
            key = self.file_key(model, digest)
            with open(path, "rb") as f, _mapped(f, size) as view:
                self.store.replace(key, view)
            files[name] = {"sha256": digest, "size": size}
        return files

    def register(
        self,
        model: str,
        *,
        run: str,
        step: int,
        manifest_digest: str,
        files: Mapping[str, Mapping[str, Any]],
        export: Mapping[str, Any] | None = None,
        lineage: Mapping[str, Any] | None = None,
        stage: str | None = "latest",
    ) -> ModelVersion:
        """Claim the next version number (create-only) for already uploaded ``files``,
        then move aliases for ``stage``: "latest" (``latest`` to the newest version),
        "stable" (also ``stable`` to it, the old stable to ``fallback``), or None."""
        if stage not in ("latest", "stable", None):
            raise RegistryError(f"stage {stage!r} is not 'latest', 'stable' or None")
        for name, f in files.items():
            self.file_key(model, f["sha256"])  # a digest, or refuse before claiming a number
            if problem := alias_records.file_name_problem(name):
                raise RegistryError(f"model {model!r}: {problem}; nothing registered")
        if stage is not None:  # an alias record a move could not read: refuse before claiming a number
            self._read_aliases(model)
        version = max(self.version_numbers(model), default=0) + 1
        for _ in range(CAS_ATTEMPTS):
            mv = ModelVersion(
                model=model,
                version=version,
                run=run,
                step=step,
                partition_key=fmt.checkpoint_name(run, step),
                manifest_digest=manifest_digest,
                files={n: dict(f) for n, f in files.items()},
                export=dict(export or {}),
                lineage=dict(lineage or {}),
                created_at=time.time(),
            )
            body = json.dumps(mv.to_json(), sort_keys=True).encode()
            if self.store.put_if_absent(self.version_key(model, version), body):
                break
            version += 1  # another promotion took this number
        else:
            raise RegistryError(f"could not claim a version number for model {model!r}")
        if stage == "latest":
            self.move(model, "register", lambda a: {**a, "latest": self._newest(model, a, version)})
        elif stage == "stable":
            self.move(model, "promote", lambda a: _promoted({**a, "latest": self._newest(model, a, version)}, version))
        return mv

    def _newest(self, model: str, aliases: Aliases, version: int) -> int:
        """What ``latest`` names once ``version`` is registered: the newer of the two, unless
        the one ``latest`` names does not read (edited by hand): then ``version``."""
        current = aliases.get("latest", 0)
        if current <= version:
            return version
        try:
            self.get(model, current)
        except RegistryError:
            return version
        return current

    def move(self, model: str, action: str, change: Callable[[Aliases], Aliases]) -> Aliases:
        """Apply ``change`` to the current aliases by compare-and-swap, retrying on a
        concurrent move (``change`` is recomputed from what is there then)."""
        move_id = uuid.uuid4().hex
        for attempt in range(CAS_ATTEMPTS):
            doc, version = self._read_aliases(model)
            if doc.get("move", {}).get("id") == move_id:
                return dict(doc["aliases"])  # our write landed; its response was lost
            aliases = change(dict(doc["aliases"]))
            # what this move sets must name a version; an alias it leaves alone is not its to check,
            # so a broken one never blocks the move that repairs it (set_alias)
            self._check_aliases(model, {a: v for a, v in aliases.items() if doc["aliases"].get(a) != v})
            new = {"aliases": aliases, "move": {"id": move_id, "action": action, "at": time.time()}}
            if self.store.replace_if(self._aliases_key(model), json.dumps(new, sort_keys=True).encode(), version):
                return aliases
            time.sleep(random.uniform(0, 0.002 * min(attempt + 1, 50)))
        raise RegistryError(f"aliases of model {model!r} kept changing under {CAS_ATTEMPTS} attempts to {action}")

    def _check_aliases(self, model: str, aliases: Aliases) -> None:
        """Each alias is one ckptflow knows and names a version that exists."""
        for alias, v in aliases.items():
            if alias not in ALIASES:
                raise RegistryError(f"alias {alias!r} is not one of {ALIASES}")
            try:
                self.get(model, v)
            except RegistryError as e:
                raise RegistryError(
                    f"{model}@{alias} names v{v}, which does not read ({e}); "
                    f"set {alias!r} to an existing version (Registry.set_alias), then try again"
                ) from None

    def set_alias(self, model: str, alias: str, version: int) -> Aliases:
        return self.move(model, f"set {alias}", lambda a: {**a, alias: version})

    def promote(self, model: str, version: int) -> Aliases:
        """Make ``version`` stable; the previous stable becomes the fallback."""
        self.get(model, version)
        return self.move(model, "promote", lambda a: _promoted(a, version))

    def rollback(self, model: str) -> Aliases:
        """stable <- fallback. The rolled-back version becomes the fallback, so a second
        rollback undoes the first. A fallback whose files were deleted is refused: the
        rollback would put a version in production that no deploy can download."""

        def swap(a: Aliases) -> Aliases:
            if "fallback" not in a:
                raise RegistryError(f"model {model!r} has no fallback to roll back to (aliases: {a})")
            self._check_aliases(model, {"fallback": a["fallback"]})  # one that does not read: how to repair it
            if missing := self.missing_files(self.get(model, a["fallback"])):
                raise RegistryError(
                    f"model {model!r}: fallback v{a['fallback']} cannot be made stable, its files "
                    f"{', '.join(missing)} are missing from {self.store.url}; rebuild them from its checkpoint "
                    f"(ckptflow.lifecycle.promote.rebuild), then roll back; nothing moved"
                )
            return {**a, "stable": a["fallback"], "fallback": a.get("stable", a["fallback"])}

        return self.move(model, "rollback", swap)

    # ---- what retention must keep ------------------------------------------------------
    def pinned(self) -> set[tuple[str, int, str]]:
        """The commits (run, step, manifest digest) any version was published from: what
        ``rebuild`` needs, not whatever was committed under that name since."""
        return {(v.run, v.step, v.manifest_digest) for m in self.models() for v in self.versions(m)}

    def aliased(self) -> dict[tuple[str, int, str], list[str]]:
        """The commits an alias points to, with ``model:alias`` names."""
        out: dict[tuple[str, int, str], list[str]] = {}
        for m in self.models():
            for alias, version in self.aliases(m).items():
                v = self.get(m, version)
                out.setdefault((v.run, v.step, v.manifest_digest), []).append(f"{m}:{alias}")
        return out


def _promoted(aliases: Aliases, version: int) -> Aliases:
    old = aliases.get("stable")
    if old == version:
        return aliases
    return {**aliases, "stable": version, **({"fallback": old} if old is not None else {})}


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class _mapped:
    """A read-only memory map of an open file as a memoryview (an empty file: b"")."""

    def __init__(self, f: Any, size: int):
        self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")

    def __enter__(self) -> memoryview:
        return self._view

    def __exit__(self, *exc: object) -> None:
        self._view.release()
        if self._map is not None:
            self._map.close()


def describe(v: ModelVersion) -> dict[str, Any]:
    """Flat lineage fields for display."""
    return {
        "model": v.model,
        "version": v.version,
        "partition_key": v.partition_key,
        "run": v.run,
        "step": v.step,
        "manifest_digest": v.manifest_digest,
        "files": ", ".join(sorted(v.files)),
        "dtype": v.dtype,
    }
