"""Retention: which checkpoints to keep and why. Pure: no store, no clock, no Dagster.

Modelled on Orbax's preservation policies: each rule says which checkpoints it
*preserves* (with a reason); rules compose by union; anything no rule preserves is
expired. Keeping the decision pure means the dry-run asset, the retention job and the
tests all compute exactly the same plan from the same inputs, and applying it (delete
manifests, then GC) is a separate, boring step.

Checkpoints are named by ``(run, step)``: steps repeat across runs, so a step alone is
ambiguous in a store that holds several runs. Rules that rank checkpoints (newest,
best-K) rank within each run. A pin or alias belongs to a commit, ``(run, step,
manifest digest)``: it protects the checkpoint whose manifest has that digest, not a
later commit of the same step (a model version published from a rejected commit must
not keep its replacement).

Never-delete rules (``KeepPinned``, ``KeepAliased``, ``KeepNewestValid``, ``KeepUnread``)
are part of ``default_policy`` and additionally enforced by ``plan`` itself, so a custom
policy cannot expire a pinned, published, aliased or unreadable checkpoint by forgetting a
rule.

Tiers: the plan is for the hot tier; archive copies are never expired by retention.
``delete`` expires the hot copy (the checkpoint is gone unless an archive holds it);
with ``hot_days``, a kept checkpoint older than that whose archive copy verified is
moved to ``archive_only``: still kept, but its hot copy expires (the newest valid
checkpoint of a run always stays hot: it is what a resume loads).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ckptflow.policy.scores import one_scale

DAY = 86400.0
Ref = tuple[str, int]  # (run, step)
Commit = tuple[str, int, str]  # (run, step, manifest digest)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """What retention needs to know of one checkpoint (``CheckpointInfo`` plus verdicts)."""

    run: str
    step: int
    kind: str  # "full" | "incremental"
    created_at: float
    # per metric, its figure on each scale (``ckptflow.policy.scores.scales``): ranked on one
    scales: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    valid: bool | None = True  # None: not validated yet (treated as valid for "newest valid")
    archived: bool = False  # a copy in the archive tier verified
    archive_lossy: bool = False  # that copy was written with a lossy archive codec
    digest: str = ""  # the hot copy's manifest digest; "" if it could not be read
    unread: str = ""  # why its commit record could not be read just now (no proof of anything): kept

    @property
    def ref(self) -> Ref:
        return (self.run, self.step)

    def commits_in(self, commits: Iterable[Commit]) -> list[Commit]:
        """Those of ``commits`` that are this checkpoint: its name and manifest digest. One
        whose digest is unknown (its manifest could not be read just now) matches every
        commit of its name: retention does not delete what it cannot tell apart."""
        if self.digest:
            return [commit] if (commit := (self.run, self.step, self.digest)) in commits else []
        return [commit for commit in commits if commit[:2] == self.ref]


@dataclass(frozen=True)
class Context:
    now: float
    pinned: frozenset[Commit] = frozenset()
    aliased: Mapping[Commit, Sequence[str]] = field(default_factory=dict)  # commit -> alias names

    def aliases_of(self, c: Candidate) -> list[str]:
        return sorted(name for commit in c.commits_in(self.aliased) for name in self.aliased[commit])


class RetentionPolicy(Protocol):
    """A rule: the checkpoints it preserves, each with a human-readable reason."""

    def preserve(self, checkpoints: Sequence[Candidate], ctx: Context) -> dict[Ref, str]: ...


def _by_run(checkpoints: Iterable[Candidate]) -> dict[str, list[Candidate]]:
    runs: dict[str, list[Candidate]] = defaultdict(list)
    for c in checkpoints:
        runs[c.run].append(c)
    return runs


@dataclass(frozen=True)
class KeepRecent:
    """Everything younger than ``days``: recent history is what a resume or an
    investigation of a fresh regression needs, whatever its kind or validity."""

    days: float = 7

    def preserve(self, checkpoints: Sequence[Candidate], ctx: Context) -> dict[Ref, str]:
        return {
            c.ref: f"younger than {self.days:g} days" for c in checkpoints if ctx.now - c.created_at < self.days * DAY
        }


@dataclass(frozen=True)
class KeepFullWithin:
    """Full checkpoints younger than ``days``: they restore without depending on bytes
    written by older saves, so they are the cheap long-range history."""

    days: float = 30

    def preserve(self, checkpoints: Sequence[Candidate], ctx: Context) -> dict[Ref, str]:
        return {
            c.ref: f"full checkpoint younger than {self.days:g} days"
            for c in checkpoints
            if c.kind == "full" and c.valid is not False and ctx.now - c.created_at < self.days * DAY
        }


def rank_by_metric(
    checkpoints: Iterable[Candidate], metric: str, mode: str = "min", *, scale: str | None = None
) -> list[tuple[Candidate, float]]:
    """Checkpoints that have ``metric`` on the scale they share (``scores.one_scale``), best
    first (``mode`` "min" or "max"), with that figure; a tie goes to the newer step. The one
    ranking retention's best-K and promotion share. ``scale``: the one ``scores.scale_of``
    chose among more commits than these (promotion: those not validated yet too)."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    sign = 1 if mode == "min" else -1
    candidates = list(checkpoints)
    figures, _ = one_scale({at: c.scales.get(metric) or {} for at, c in enumerate(candidates)}, scale=scale)
    ranked = [(candidates[at], figure) for at, figure in figures.items()]
    return sorted(ranked, key=lambda item: (sign * item[1], -item[0].step))


@dataclass(frozen=True)
class KeepBestK:
    """The ``k`` best valid checkpoints of each run by ``metric`` (``mode`` "min" or "max"):
    the candidates for deployment, kept however old they are."""

    metric: str
    k: int = 3
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")

    def preserve(self, checkpoints: Sequence[Candidate], ctx: Context) -> dict[Ref, str]:
        out = {}
        for cands in _by_run(checkpoints).values():
            scored = rank_by_metric([c for c in cands if c.valid is not False], self.metric, self.mode)
            for rank, (c, figure) in enumerate(scored[: self.k], 1):
                out[c.ref] = f"best {rank} of {len(scored)} by {self.mode} {self.metric} ({figure:.4g})"
        return out


@dataclass(frozen=True)
class KeepNewestValid:
    """The newest checkpoint of each run that is not known to be invalid and whose commit
    record was read: the one a resume would load. Deleting it would lose training progress."""

    def preserve(self, checkpoints: Sequence[Candidate], ctx: Context) -> dict[Ref, str]:
        out = {}
        for cands in _by_run(checkpoints).values():
            valid = [c for c in cands if c.valid is not False and not c.unread]
            if valid:
                out[max(valid, key=lambda c: c.step).ref] = "newest valid checkpoint of its run"
        return out


@dataclass(frozen=True)
class KeepPinned:
    """Pinned or published checkpoints, forever: someone promised they stay."""

    def preserve(self, checkpoints: Sequence[Candidate], ctx: Context) -> dict[Ref, str]:
        return {c.ref: "pinned / published" for c in checkpoints if c.commits_in(ctx.pinned)}


@dataclass(frozen=True)
class KeepAliased:
    """Anything a model alias (latest, stable, fallback) points to: a rollback target
    must still exist when it is needed."""

    def preserve(self, checkpoints: Sequence[Candidate], ctx: Context) -> dict[Ref, str]:
        return {c.ref: "model alias " + ", ".join(names) for c in checkpoints if (names := ctx.aliases_of(c))}


@dataclass(frozen=True)
class AnyOf:
    """Union of rules: a checkpoint is kept if any rule preserves it (all reasons kept)."""

    rules: tuple[RetentionPolicy, ...]

    def preserve_all(self, checkpoints: Sequence[Candidate], ctx: Context) -> dict[Ref, list[str]]:
        out: dict[Ref, list[str]] = defaultdict(list)
        for rule in self.rules:
            for ref, reason in rule.preserve(checkpoints, ctx).items():
                out[ref].append(reason)
        return dict(out)

    def preserve(self, checkpoints: Sequence[Candidate], ctx: Context) -> dict[Ref, str]:
        return {ref: "; ".join(reasons) for ref, reasons in self.preserve_all(checkpoints, ctx).items()}


@dataclass(frozen=True)
class KeepUnread:
    """Checkpoints whose commit record could not be read just now (an outage, a cold or
    denied object, a format a newer ckptflow wrote): nothing proves them bad or old, and
    expiring one deletes it. The next plan, made when the record reads, decides."""

    def preserve(self, checkpoints: Sequence[Candidate], ctx: Context) -> dict[Ref, str]:
        return {
            c.ref: f"its commit record could not be read ({c.unread}): no decision without it"
            for c in checkpoints
            if c.unread
        }


NEVER_DELETE: tuple[RetentionPolicy, ...] = (KeepPinned(), KeepAliased(), KeepNewestValid(), KeepUnread())


def default_policy(
    *, recent_days: float = 7, full_days: float = 30, best_k: int = 3, metric: str = "val_loss", mode: str = "min"
) -> AnyOf:
    """The default policy: recent, full-within, best K, and the never-delete rules."""
    rules: list[RetentionPolicy] = [KeepRecent(recent_days), KeepFullWithin(full_days)]
    if best_k > 0:
        rules.append(KeepBestK(metric, best_k, mode))
    return AnyOf((*rules, *NEVER_DELETE))


@dataclass
class RetentionPlan:
    keep: dict[Ref, list[str]]
    delete: dict[Ref, str]
    archive_only: dict[Ref, str] = field(default_factory=dict)  # kept, in the archive tier only
    digests: dict[Ref, str] = field(default_factory=dict)  # the commit each decision is about ("": unread then)
    protected: frozenset[Commit] = frozenset()  # the pinned and aliased commits the plan knew of

    @property
    def expire_hot(self) -> list[Ref]:
        """Every checkpoint whose hot copy goes: deleted ones and archive-only ones."""
        return sorted({*self.delete, *self.archive_only})

    def verdict(self, ref: Ref) -> str:
        if ref in self.archive_only:
            reasons = "; ".join([self.archive_only[ref], *self.keep[ref]])
            return "keep in archive only (hot copy expires): " + reasons
        if ref in self.keep:
            return "keep: " + "; ".join(self.keep[ref])
        if ref in self.delete:
            return "delete: " + self.delete[ref]
        return "unknown"


def plan(
    checkpoints: Sequence[Candidate],
    now: float,
    *,
    pinned: Iterable[Commit] = (),
    aliased: Mapping[Commit, Sequence[str]] | None = None,
    policy: RetentionPolicy | None = None,
    hot_days: float | None = None,
) -> RetentionPlan:
    """Split ``checkpoints`` into keep (with every reason) and delete (with why).

    The never-delete rules are always applied on top of ``policy``. With ``hot_days``,
    kept checkpoints older than that with a verified archive copy go to ``archive_only``,
    except pinned, published and aliased ones whose archive copy is lossy: their exact
    copy stays hot.
    """
    ctx = Context(now=now, pinned=frozenset(pinned), aliased=dict(aliased or {}))
    policy = policy or default_policy()
    rules = policy.rules if isinstance(policy, AnyOf) else (policy,)
    rules = (*rules, *(r for r in NEVER_DELETE if r not in rules))
    keep = AnyOf(tuple(rules)).preserve_all(checkpoints, ctx)
    delete = {}
    for c in sorted(checkpoints, key=lambda c: c.ref):
        if c.ref not in keep:
            age = (now - c.created_at) / DAY
            status = "invalid, " if c.valid is False else ""
            delete[c.ref] = f"{status}{c.kind}, {age:.1f} days old: no retention rule keeps it"
    archive_only = {}
    if hot_days is not None:
        newest = KeepNewestValid().preserve(checkpoints, ctx)
        for c in sorted(checkpoints, key=lambda c: c.ref):
            exact_required = c.archive_lossy and bool(c.commits_in(ctx.pinned) or c.commits_in(ctx.aliased))
            if c.ref in keep and c.ref not in newest and c.archived and now - c.created_at >= hot_days * DAY:
                if not exact_required:
                    archive_only[c.ref] = f"archived and older than {hot_days:g} days"
    digests = {c.ref: c.digest for c in checkpoints}
    return RetentionPlan(
        keep=dict(sorted(keep.items())),
        delete=delete,
        archive_only=archive_only,
        digests=digests,
        protected=ctx.pinned | frozenset(ctx.aliased),
    )
