"""One row per checkpoint across tiers, with every lifecycle verdict and the retention plan.

A library function (not a Dagster asset body) so the inventory asset, the retention
job, the demo summary and any script agree on what exists, what is valid and what
retention would do. Reads each manifest once and lists lifecycle records once; the
records shown are those of the commit each row describes (its manifest digest), so a
step committed again after a rejected first commit shows its own verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import selection
from ckptflow.catalog.listing import Problem
from ckptflow.catalog.verdicts import records_by_subject
from ckptflow.policy.retention import Candidate, RetentionPlan, RetentionPolicy, plan
from ckptflow.policy.scores import held_figures, scales, scores
from ckptflow.store.base import Store


@dataclass
class Entry:
    run: str
    step: int
    kind: str = "?"
    created_at: float = 0.0
    tiers: list[str] = field(default_factory=list)
    logical_bytes: int = 0
    stored_bytes: int = 0
    chunks: int = 0
    world_size: int = 0
    base_step: int | None = None
    digest: str = ""
    source_digest: str = ""  # an archive-only lossy copy: the exact commit its records are keyed by
    lossy: bool = False  # the commit described is a lossy copy (not the trained model: never promoted)
    manifest_error: str = ""
    manifest_unread: bool = False  # that error proves nothing: the record could not be read (``Problem.UNREAD``)
    commits: dict[str, str] = field(default_factory=dict)  # per tier, the commit read there (or NEWER_COMMIT)
    records: dict[str, dict] = field(default_factory=dict)  # lifecycle records by kind
    trainer_metadata: dict = field(default_factory=dict)
    commit_metadata: dict[str, dict] = field(default_factory=dict)  # the metadata of each tier's commit, by digest
    commit_records: dict[str, dict] = field(default_factory=dict)  # each commit's lifecycle records, by digest

    @property
    def ref(self) -> tuple[str, int]:
        return (self.run, self.step)

    @property
    def validation(self) -> str:
        """passed / failed / unreadable / not checked. A damaged manifest is failed; one that
        could not be read just now (an outage, a cold or denied object, a newer format) is
        unreadable: no verdict either way."""
        if self.manifest_error:
            return "unreadable" if self.manifest_unread else "failed"
        record = self.records.get("validation")
        if record is None:
            return "not checked"
        return "passed" if record.get("ok") else "failed"

    @property
    def valid(self) -> bool | None:
        return {"passed": True, "failed": False}.get(self.validation)

    @property
    def metrics(self) -> dict[str, float]:
        """Its scores, by the rule ``Best`` and retention's best-K share (``ckptflow.policy.scores``)."""
        return scores(self.trainer_metadata, self.records)

    @property
    def archived(self) -> bool:
        """The archive tier holds this checkpoint and archival verified the copy there."""
        return "archive" in self.tiers and bool((self.records.get("archive") or {}).get("ok"))

    @property
    def archive_lossy(self) -> dict | None:
        """What the archive copy lost, if archival wrote it with a lossy codec."""
        return (self.records.get("archive") or {}).get("lossy") or None

    def held_commits(self, metric: str) -> dict[str, dict[str, float]]:
        """The figures of ``metric`` (``scores.held_figures``) of each commit a tier may hold at
        this step, by that commit's own records and metadata: the one it describes, an earlier
        one only the archive holds (the step committed again since), a lossy copy; where a
        tier's commit is not known (its commit record damaged, unread, a newer format's) any
        commit recorded at the step may be it. ``Best`` counts these in choosing its scale,
        so promotion counts them too, whatever the entry's own ``valid`` says of its hot copy."""
        held = set(self.commits.values()) - {selection.NEWER_COMMIT}
        if len(self.commits) < len(self.tiers) or selection.NEWER_COMMIT in self.commits.values():
            held |= set(self.commit_records)
        figures = {
            d: held_figures(self.commit_metadata.get(d, {}), self.commit_records.get(d, {}), metric) for d in held
        }
        return {digest: by for digest, by in figures.items() if by is not None}

    def candidate(self) -> Candidate:
        return Candidate(
            run=self.run,
            step=self.step,
            kind=self.kind,
            created_at=self.created_at,
            scales=scales(self.trainer_metadata, self.records),
            valid=self.valid,
            archived=self.archived,
            archive_lossy=self.archive_lossy is not None,
            digest=self.digest if not self.manifest_error else "",  # unknown: protected by any pin of its name
            unread=self.manifest_error if self.manifest_unread else "",
        )


def _scan(store: Store, tier: str, entries: dict[tuple[str, int], Entry]) -> None:
    for item in catalog.summaries(store):
        if isinstance(item, Problem):
            if item.step is None:
                continue  # a run that cannot be listed, or a stray directory: not a checkpoint
            entry = entries.setdefault((item.run, item.step), Entry(item.run, item.step))
            entry.tiers.append(tier)
            if item.kind == "newer":
                entry.commits[tier] = selection.NEWER_COMMIT
            if not entry.manifest_error and not entry.digest:  # the hot copy, read, describes it (scrub checks this)
                entry.manifest_error, entry.manifest_unread = item.message, item.could_not_read
            continue
        entry = entries.setdefault((item.run, item.step), Entry(item.run, item.step))
        entry.tiers.append(tier)
        entry.commits[tier] = item.digest
        entry.commit_metadata[item.digest] = dict(item.metadata)
        if entry.digest or entry.manifest_unread:
            # the hot copy describes it (the archive copy is the same commit, or reported as differing), or its
            # hot commit record could not be read: that commit may differ from the archive's, so nothing is decided
            continue
        # a hot commit record proved damaged keeps its error: the archive copy describes the
        # checkpoint, but the hot copy is not one a resume can load, so retention must not count it valid
        entry.kind, entry.created_at, entry.digest = item.kind, item.created_at, item.digest
        entry.source_digest, entry.lossy = (item.lossy or {}).get("source_digest", ""), item.lossy is not None
        entry.base_step = item.base_step
        entry.logical_bytes, entry.stored_bytes, entry.chunks = item.logical_bytes, item.stored_bytes, item.chunks
        entry.world_size, entry.trainer_metadata = item.world_size, dict(item.metadata)


def collect(hot: Store, archive: Store | None = None) -> list[Entry]:
    """Every committed checkpoint in the hot store and (if given) the archive, by
    (run, step), with the lifecycle records of the commit it describes (its digest)."""
    entries: dict[tuple[str, int], Entry] = {}
    _scan(hot, "hot", entries)
    if archive is not None:
        _scan(archive.metadata_store(), "archive", entries)
    for (run, step, digest), records in records_by_subject(hot).items():
        entry = entries.get((run, step))
        if entry is None:
            continue
        entry.commit_records[digest] = records
        if digest == entry.digest:  # the commit's own verdicts
            entry.records = {**entry.records, **records}
        elif digest == entry.source_digest:  # a lossy copy: the exact commit's, unless it has its own
            entry.records = {**records, **entry.records}
    return [entries[k] for k in sorted(entries)]


def retention_plan(
    entries: list[Entry],
    now: float,
    *,
    pinned=(),
    aliased=None,
    policy: RetentionPolicy | None = None,
    hot_days: float | None = None,
) -> RetentionPlan:
    """The plan for the hot tier (archive-only checkpoints are not retention's to delete)."""
    return plan(
        [e.candidate() for e in entries if "hot" in e.tiers],
        now,
        pinned=pinned,
        aliased=aliased,
        policy=policy,
        hot_days=hot_days,
    )


def rows(entries: list[Entry], retention: RetentionPlan | None = None) -> list[dict]:
    """Flat rows for a table: identity, tiers, bytes, status, metrics, verdict."""
    out = []
    for e in entries:
        compression = e.records.get("compression") or {}
        failure = e.records.get("failure") or {}
        row = {
            "run": e.run,
            "step": e.step,
            "kind": e.kind,
            "tiers": ",".join(e.tiers),
            "logical_bytes": e.logical_bytes,
            "stored_bytes": compression.get("bytes_after", e.stored_bytes),
            "compression_ratio": compression.get("ratio"),
            "archive_copy": "" if not e.archived else "lossy" if e.archive_lossy else "exact",
            "validation": e.validation,
            "problem": (e.manifest_error or "; ".join((e.records.get("validation") or {}).get("problems", [])))[:200],
            "last_failure": failure.get("message", "")[:200],
            "overfitting": (e.records.get("evaluation") or {}).get("overfitting"),
        }
        row.update({f"metric.{k}": v for k, v in sorted(e.metrics.items())})
        if retention is not None:
            row["retention"] = retention.verdict(e.ref) if "hot" in e.tiers else "archive only"
        out.append(row)
    return out


def plan_rows(entries: list[Entry], retention: RetentionPlan) -> list[dict]:
    """The retention plan as a table: per checkpoint the action (keep, archive only,
    delete) and why, and what happens to each copy: retention expires hot copies only,
    so an archived checkpoint keeps its archive copy whatever the action."""
    archived = {e.ref for e in entries if e.archived}

    def row(ref, action: str, why: str) -> dict:
        hot = "expire" if ref in retention.archive_only or ref in retention.delete else "keep"
        return {
            "run": ref[0],
            "step": ref[1],
            "action": action,
            "hot": hot,
            "archive": "keep" if ref in archived else "-",
            "why": why,
        }

    kept = [
        row(
            ref,
            "archive only" if ref in retention.archive_only else "keep",
            "; ".join(([retention.archive_only[ref]] if ref in retention.archive_only else []) + why),
        )
        for ref, why in retention.keep.items()
    ]
    return kept + [row(ref, "delete", why) for ref, why in retention.delete.items()]


def recovery_choices(hot: Store, entries: list[Entry], *, metric: str = "val_loss", mode: str = "min") -> list[dict]:
    """Per run, the step each selector would recover to now: ``latest`` (or where it stops:
    restore never passes a checkpoint it could not read), ``validated`` and ``best`` (by
    ``metric`` and ``mode``), chosen by the rule restore applies
    (``ckptflow.catalog.selection``), from the commits the inventory already read in each
    tier: a step the hot tier holds in another commit than the one a verdict names
    recovers from the archive copy when that is the commit, as restore does."""
    by_run: dict[str, list[Entry]] = {}
    unread: dict[str, int] = {}  # each run's newest step whose hot commit record could not be read
    for e in entries:
        if e.manifest_unread:
            unread[e.run] = max(unread.get(e.run, -1), e.step)
        if any(digest != selection.NEWER_COMMIT for digest in e.commits.values()):
            by_run.setdefault(e.run, []).append(e)
    out = []
    best = selection.Best(metric, mode)
    for run, found in sorted(by_run.items()):
        pairs, digests, metadata = [], {}, {}
        for e in sorted(found, key=lambda e: -e.step):
            metadata.update(e.commit_metadata)
            for index, tier in enumerate(("hot", "archive")):
                if tier in e.commits:
                    pairs.append((e.step, index))
                    digests[(e.step, index)] = e.commits[tier]
        picks: dict[str, int | str | None] = {}
        for name, select in (("validated", "validated"), ("best", best)):
            choice = selection.choose([hot], run, select, pairs, digests=digests, metadata=metadata)
            if choice.pairs:
                picks[name] = choice.pairs[0][0]
            else:  # a verdict it needs did not read: restore stops there too
                picks[name] = "stops (a lifecycle record is unreadable)" if choice.stop else None
        stop = unread.get(run, -1)
        latest: int | str = pairs[0][0] if stop < pairs[0][0] else f"stops at {stop} (unreadable)"
        out.append({"run": run, "latest": latest, **picks, "best_by": selection.describe(best)})
    return out
