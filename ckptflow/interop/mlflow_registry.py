"""A mirror of ckptflow's model registry in an MLflow Model Registry.

ML teams deploy from a registry they already run, most often MLflow. ckptflow's registry
(``ckptflow.interop.registry``) stays the source of truth: the mirror only ever copies
from it, and ``sync`` makes MLflow say what ckptflow says, so running it again changes
nothing and running it after a failure finishes what the failure left undone.

For each ckptflow version of a model, ``sync`` makes one MLflow run (experiment
``ckptflow-models`` by default) holding the version's exported files under ``model/``
(downloaded from ckptflow's registry and checked against their sha256 first), then one
MLflow model version whose source is those files, tagged with its lineage: ckptflow
version, run, step, checkpoint partition (and a link to it when ``partition_link`` is
given), manifest digest, the validation verdict, evaluation metrics, data and training
config references and the files' sha256. Each step finds what an earlier, interrupted
sync already did (by the ``ckptflow.model`` / ``ckptflow.version`` tags) instead of
doing it twice.

Aliases: ``stable`` and ``fallback`` are set on the MLflow versions that mirror the
ckptflow versions they name, and ``latest`` as ``newest`` (MLflow reserves the alias name
``latest``: ``models:/<name>/latest`` is its highest version number, whatever ckptflow
says); each is removed where ckptflow has none (``MLFLOW_ALIASES``); a rollback
in ckptflow moves them on the next sync. MLflow has no compare-and-swap on aliases, so
ckptflow's compare-and-swap decides and the mirror converges: after setting them, it
reads ckptflow's aliases again and repeats if they moved meanwhile, so the last sync to
finish leaves MLflow with ckptflow's current aliases, never a stale set.

Every MLflow call is retried (``attempts``, exponential wait); once they are spent the
sync raises ``MirrorError``. ckptflow's registry is never written here. ``mlflow`` is
imported only when a mirror is made (``pip install 'ckptflow[mlflow]'``).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ckptflow.errors import CkptflowError, MirrorError, retrying_may_help
from ckptflow.interop.registry import ALIASES, ModelVersion, Registry

T = TypeVar("T")

TAG = "ckptflow."
PARTITION_TAG = TAG + "partition_key"
ARTIFACT_PATH = "model"
COMPLETE_TAG = TAG + "artifacts"  # on the MLflow run once every file is logged
MAX_TAG_CHARS = 5000  # what MLflow accepts in a model version tag value
ALIAS_ROUNDS = 5
MLFLOW_ALIASES = {"latest": "newest", "stable": "stable", "fallback": "fallback"}  # ckptflow alias -> MLflow's
PERMANENT = {"INVALID_PARAMETER_VALUE", "PERMISSION_DENIED", "UNAUTHENTICATED"}  # MLflow errors a retry repeats


@dataclass(frozen=True, kw_only=True)
class MirrorResult:
    """What one ``sync`` found and did for one model."""

    model: str  # the ckptflow model
    registered_model: str  # its name in MLflow
    versions: dict[int, str] = field(default_factory=dict)  # ckptflow version -> MLflow version
    created: list[int] = field(default_factory=list)  # ckptflow versions this sync registered in MLflow
    aliases: dict[str, str] = field(default_factory=dict)  # MLflow alias -> MLflow version, after the sync
    moved: list[str] = field(default_factory=list)  # MLflow aliases this sync set or removed

    @property
    def changed(self) -> bool:
        return bool(self.created or self.moved)


def lineage_tags(
    mv: ModelVersion, *, store_url: str = "", partition_link: str = "", partition_key: str | None = None
) -> dict[str, str]:
    """The MLflow tags of a mirrored version: where it came from, as strings.
    ``partition_key``: the orchestrator's key of its checkpoint where that is not the
    checkpoint's name (a partition an older Dagster instance added under its former name)."""
    partition_key = partition_key or mv.partition_key
    lineage = mv.lineage or {}
    validation = lineage.get("validation") or {}
    evaluation = lineage.get("evaluation") or {}
    verdict = "passed" if validation.get("ok") else ("failed" if validation else "unknown")
    tags = {
        "model": mv.model,
        "version": str(mv.version),
        "run": mv.run,
        "step": str(mv.step),
        "partition_key": partition_key,
        "manifest_digest": mv.manifest_digest,
        "validation": verdict,
        "evaluator": str(evaluation.get("evaluator") or ""),
        "data": _json_tag(lineage.get("data")),
        "training_config": _json_tag(lineage.get("training_config") or {}),
        "export": _json_tag(mv.export),
        "files": _json_tag({n: f["sha256"] for n, f in sorted(mv.files.items())}),
    }
    for name, value in sorted((evaluation.get("metrics") or {}).items()):
        tags[f"metric.{name}"] = repr(value) if isinstance(value, float) else str(value)
    if store_url:
        tags["registry"] = store_url
    if partition_link:
        tags["partition_link"] = partition_link.format(partition_key=partition_key, run=mv.run, step=mv.step)
    return {TAG + k: v for k, v in tags.items()}


def _json_tag(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= MAX_TAG_CHARS else f"({len(text)} characters: see the ckptflow registry's version)"


class MlflowMirror:
    """Mirror ckptflow models into the MLflow Model Registry at ``tracking_uri``.

    ``registered_model`` names the MLflow model of a ckptflow model (``"{model}"``: the
    same name). ``partition_link``: a URL template (``{partition_key}``, ``{run}``,
    ``{step}``) tagged on each version, e.g. the checkpoint partition's Dagster page."""

    def __init__(
        self,
        tracking_uri: str,
        *,
        registered_model: str = "{model}",
        experiment: str = "ckptflow-models",
        partition_link: str = "",
        attempts: int = 4,
        wait_s: float = 1.0,
    ):
        try:
            from mlflow import MlflowClient
        except ImportError as e:
            raise ImportError(f"the MLflow mirror needs mlflow: pip install 'ckptflow[mlflow]' ({e})") from e
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {attempts}")
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self.registered_model = registered_model
        self.experiment = experiment
        self.partition_link = partition_link
        self.attempts = attempts
        self.wait_s = wait_s

    def name_of(self, model: str) -> str:
        return self.registered_model.format(model=model)

    # ---- the one entry point -----------------------------------------------------------
    def sync(
        self, registry: Registry, model: str, *, partition_keys: Mapping[tuple[str, int], str] | None = None
    ) -> MirrorResult:
        """Make MLflow's ``name_of(model)`` hold every ckptflow version of ``model`` and
        the same aliases. Idempotent; raises ``MirrorError`` once an MLflow call has
        failed ``attempts`` times (ckptflow's registry is untouched either way).
        ``partition_keys``: (run, step) -> the partition key the orchestrator holds for
        that checkpoint, where new versions' tags and links should name another key than
        the checkpoint's name."""
        name, held = self.name_of(model), partition_keys or {}
        self._call(f"create registered model {name!r}", self._ensure_registered_model, name)
        existing = self._call(f"list the versions of {name!r}", self._mirrored_versions, name)
        result = MirrorResult(model=model, registered_model=name)
        for mv in registry.versions(model):
            if mv.version in existing:
                self._check_same(name, mv, existing[mv.version])
                result.versions[mv.version] = existing[mv.version].version
                continue
            mirrored = self._mirror_version(registry, mv, name, held)
            result.versions[mv.version] = mirrored.version
            result.created.append(mv.version)
        self._sync_aliases(registry, model, name, result, held)
        return result

    # ---- versions ----------------------------------------------------------------------
    def _ensure_registered_model(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            try:
                self.client.create_registered_model(
                    name, tags={TAG + "mirror": "true"}, description="Mirrored from a ckptflow registry."
                )
            except MlflowException as again:
                if again.error_code != "RESOURCE_ALREADY_EXISTS":  # a concurrent sync made it
                    raise

    def _mirrored_versions(self, name: str) -> dict[int, Any]:
        """ckptflow version -> the MLflow version that mirrors it (the oldest, if a race made two)."""
        out: dict[int, Any] = {}
        for v in self.client.search_model_versions(f"name = '{name}'"):
            mirrored = v.tags.get(TAG + "version")
            if mirrored and mirrored.isdigit():
                number = int(mirrored)
                if number not in out or int(v.version) < int(out[number].version):
                    out[number] = v
        return out

    def _check_same(self, name: str, mv: ModelVersion, mirrored: Any) -> None:
        digest = mirrored.tags.get(TAG + "manifest_digest")
        if digest != mv.manifest_digest:
            raise MirrorError(
                f"MLflow model {name!r} version {mirrored.version} mirrors ckptflow {mv.model} v{mv.version} from "
                f"manifest {digest}, but ckptflow's v{mv.version} is from {mv.manifest_digest}: another ckptflow "
                f"registry mirrors into this MLflow model; give this mirror its own registered_model name"
            )

    def _mirror_version(
        self, registry: Registry, mv: ModelVersion, name: str, held: Mapping[tuple[str, int], str]
    ) -> Any:
        key = held.get((mv.run, mv.step))
        tags = lineage_tags(mv, store_url=registry.store.url, partition_link=self.partition_link, partition_key=key)
        run_tags = {**tags, TAG + "registered_model": name}
        run_id = self._call(f"log {mv.model} v{mv.version}'s files", self._logged_run, registry, mv, run_tags)
        return self._call(
            f"register {mv.model} v{mv.version} as a version of {name!r}",
            self._create_version,
            name,
            mv,
            run_id,
            tags,
        )

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(self.experiment))
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            made = self.client.get_experiment_by_name(self.experiment)  # a concurrent sync made it
            if made is None:
                raise
            return str(made.experiment_id)

    def _logged_run(self, registry: Registry, mv: ModelVersion, tags: Mapping[str, str]) -> str:
        """The MLflow run holding ``mv``'s files for this MLflow model: found by its tags,
        or made; files logged unless an earlier sync finished logging them. A found run
        must also name ``mv``'s commit and files: one that another registry's failed sync
        left under the same model and version number holds other bytes."""
        experiment_id = self._experiment_id()
        found = self.client.search_runs(
            [experiment_id],
            filter_string=" and ".join(
                f"tags.`{TAG}{key}` = '{tags[TAG + key]}'" for key in ("registered_model", "model", "version")
            ),
            order_by=["attributes.start_time ASC"],
        )
        same = ("manifest_digest", "files")
        runs = [r for r in found if all(r.data.tags.get(TAG + key) == tags[TAG + key] for key in same)]
        run = runs[0] if runs else self.client.create_run(experiment_id, tags=dict(tags), run_name=_run_name(mv))
        run_id = str(run.info.run_id)
        if run.data.tags.get(COMPLETE_TAG) != "complete":
            with tempfile.TemporaryDirectory() as tmp:
                registry.download(mv, tmp)  # each file checked against its sha256
                self.client.log_artifacts(run_id, tmp, ARTIFACT_PATH)
            for metric, value in sorted(((mv.lineage.get("evaluation") or {}).get("metrics") or {}).items()):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.client.log_metric(run_id, metric, float(value), step=mv.step)
            self.client.set_tag(run_id, COMPLETE_TAG, "complete")
            self.client.set_terminated(run_id)
        return run_id

    def _create_version(self, name: str, mv: ModelVersion, run_id: str, tags: Mapping[str, str]) -> Any:
        existing = self._mirrored_versions(name)  # a create whose response was lost
        if mv.version in existing:
            return existing[mv.version]
        return self.client.create_model_version(
            name,
            source=f"runs:/{run_id}/{ARTIFACT_PATH}",
            run_id=run_id,
            tags=dict(tags),
            description=f"ckptflow {mv.model} v{mv.version}: {tags[PARTITION_TAG]} (manifest {mv.manifest_digest})",
        )

    # ---- aliases -----------------------------------------------------------------------
    def _sync_aliases(
        self, registry: Registry, model: str, name: str, result: MirrorResult, held: Mapping[tuple[str, int], str]
    ) -> None:
        for _ in range(ALIAS_ROUNDS):
            wanted = registry.aliases(model)
            current = self._call(f"read the aliases of {name!r}", self._mlflow_aliases, name)
            for alias in ALIASES:
                theirs = MLFLOW_ALIASES[alias]
                target = result.versions.get(wanted[alias]) if alias in wanted else None
                if alias in wanted and target is None:  # registered after this sync listed the versions
                    mv = registry.get(model, wanted[alias])
                    target = result.versions[mv.version] = self._mirror_version(registry, mv, name, held).version
                    result.created.append(mv.version)
                if target is not None and current.get(theirs) != str(target):
                    self._call(f"set {name}@{theirs}", self.client.set_registered_model_alias, name, theirs, target)
                    result.moved.append(theirs)
                elif target is None and theirs in current:
                    self._call(f"remove {name}@{theirs}", self.client.delete_registered_model_alias, name, theirs)
                    result.moved.append(theirs)
            if registry.aliases(model) == wanted:  # nothing moved in ckptflow meanwhile
                result.aliases.update(
                    {MLFLOW_ALIASES[a]: str(result.versions[v]) for a, v in wanted.items() if a in MLFLOW_ALIASES}
                )
                return
        raise MirrorError(
            f"ckptflow's aliases of {model!r} kept moving during {ALIAS_ROUNDS} rounds; sync again", retry=True
        )

    def _mlflow_aliases(self, name: str) -> dict[str, str]:
        return {str(a): str(v) for a, v in (self.client.get_registered_model(name).aliases or {}).items()}

    # ---- retries -----------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, retried ``attempts`` times with an exponential wait; then a
        ``MirrorError`` that says what failed, where, and that syncing again finishes it.
        An error of ckptflow's own (a registry file that rotted, its store unavailable
        after the store's retries) is no MLflow failure: no retry, a MirrorError naming it whole."""
        for attempt in range(self.attempts):
            try:
                return fn(*args)
            except MirrorError:
                raise
            except CkptflowError as e:  # ckptflow's registry (a rotted file, an outage), which no MLflow retry fixes
                raise MirrorError(
                    f"could not {what}: ckptflow's registry failed, not MLflow: {e}; "
                    "the mirror stays behind until that is fixed and a sync runs again",
                    retry=retrying_may_help(e),  # an outage may pass; a cold object waits for a thaw
                ) from e
            except Exception as e:  # MLflow raises MlflowException, requests' and OS errors alike
                last = e
                if getattr(e, "error_code", None) in PERMANENT:
                    raise MirrorError(
                        f"MLflow at {self.tracking_uri} refused to {what}: {_first_line(e)}; ckptflow's registry "
                        f"is unchanged"
                    ) from e
                if attempt + 1 < self.attempts:
                    time.sleep(self.wait_s * 2**attempt)
        raise MirrorError(
            f"could not {what} in MLflow at {self.tracking_uri} after {self.attempts} attempts "
            f"({type(last).__name__}: {_first_line(last)}); ckptflow's registry is unchanged and stays the source "
            f"of truth: sync again to finish the mirror",
            retry=True,
        ) from last


def _run_name(mv: ModelVersion) -> str:
    return f"{mv.model}-v{mv.version}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""
