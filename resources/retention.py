"""The retention policy: one resource, so the inventory, the dry run and the job agree.

``checkpoint_inventory`` (its retention column), ``retention_plan`` (the dry run) and
``retention_job`` all plan with ``RetentionResource`` (they used to take the policy as
run config of the dry run and the job, and the inventory planned with the defaults, so a
configured policy showed one verdict in the inventory and applied another). A deployment
sets its policy once, in ``pipelines/definitions.py``: by default the one below, or the
JSON file named by ``CKPTFLOW_RETENTION`` (``{"recent_days": 3, "best_k": 5, ...}``, any
of the fields), read when the code location loads (a bad file stops it loading, with the
reason; a changed one needs a reload).
"""

from __future__ import annotations

import os

from dagster import ConfigurableResource
from pydantic import Field, ValidationError

from ckptflow.catalog.gc import parse_duration
from ckptflow.chunks.leases import SAVE_WAIT
from ckptflow.errors import CkptflowError
from ckptflow.format.layout import parse_checkpoint_name
from ckptflow.policy.config_files import read_config_json
from ckptflow.policy.retention import AnyOf, default_policy

RETENTION_ENV = "CKPTFLOW_RETENTION"
MAX_POLICY_BYTES = 1 << 20  # a policy is a few hundred bytes


class RetentionResource(ConfigurableResource):
    """What retention keeps (a union of rules, plus the never-delete rules every plan
    applies: pinned, published, aliased, and each run's newest valid checkpoint), how
    long GC leaves unreferenced chunks and waits for saves in flight, and which checkpoints keep
    only an archive copy."""

    recent_days: float = Field(default=7, ge=0, description="keep everything younger than this")
    full_days: float = Field(default=30, ge=0, description="keep full checkpoints younger than this")
    best_k: int = Field(default=3, ge=0, description="keep the best K checkpoints of each run by `metric` (0: none)")
    metric: str = Field(default="val_loss", description="the evaluation metric `best_k` ranks by")
    mode: str = Field(default="min", description="'min' or 'max': which end of `metric` is best")
    pinned: list[str] = Field(default_factory=list, description="checkpoint partition keys kept forever")
    gc_grace: str = Field(default="1h", description="unreferenced chunks younger than this survive GC")
    gc_wait: str = Field(
        default="60s",
        description="how long GC waits for saves in flight: the longest save's duration, async upload included",
    )
    hot_days: float | None = Field(
        default=None, ge=0, description="kept, archived checkpoints older than this keep only their archive copy"
    )
    archive_partitions: int = Field(
        default=10_000, ge=0, description="archive-only checkpoints that keep a partition (the newest)"
    )

    @classmethod
    def from_env(cls) -> RetentionResource:
        """The policy file ``CKPTFLOW_RETENTION`` names, if set; else the defaults."""
        path = os.environ.get(RETENTION_ENV)
        if not path:
            return cls()
        try:
            fields = read_config_json(path, max_bytes=MAX_POLICY_BYTES)  # never /dev/zero, nor a FIFO
            if not isinstance(fields, dict):
                raise ValueError(f"holds a JSON {type(fields).__name__}, not an object of retention fields")
            if unknown := sorted(set(fields) - set(cls.model_fields)):
                raise ValueError(f"names fields retention does not have: {unknown}")
            resource = cls(**fields)
            resource.check()
        except ValidationError as e:
            raise CkptflowError(f"{RETENTION_ENV}={path}: {_one_line(e)}; {_EXPECTED}") from None
        except (OSError, ValueError, TypeError) as e:
            raise CkptflowError(f"{RETENTION_ENV}={path}: {e}; {_EXPECTED}") from None
        return resource

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field that says nothing retention can apply:
        what ``retention_job`` asks before it expires anything (a grace GC cannot read would
        otherwise fail the run after the deletions), and the code location when it loads."""
        self.refs()
        self.policy()
        self.grace_s()
        self.wait_s()

    def grace_s(self) -> float:
        try:
            return parse_duration(self.gc_grace)
        except ValueError as e:
            raise ValueError(f"gc_grace: {e}") from None

    def wait_s(self) -> float:
        """``gc_wait`` in seconds: past ``SAVE_WAIT`` a save that starts while GC waits gives up
        before the sweep lets it in, so a wait that long is refused."""
        try:
            wait = parse_duration(self.gc_wait)
        except ValueError as e:
            raise ValueError(f"gc_wait: {e}") from None
        if not 0 <= wait <= SAVE_WAIT:
            raise ValueError(
                f"gc_wait: {self.gc_wait!r} is not from 0 to {SAVE_WAIT:g}s, the longest a save that starts "
                "meanwhile waits for GC; give the longest save's duration, under that"
            )
        return wait

    def policy(self) -> AnyOf:
        return default_policy(
            recent_days=self.recent_days,
            full_days=self.full_days,
            best_k=self.best_k,
            metric=self.metric,
            mode=self.mode,
        )

    def refs(self) -> list[tuple[str, int]]:
        """The pinned checkpoints as (run, step)."""
        return [parse_checkpoint_name(key) for key in self.pinned]


def _one_line(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())


_EXPECTED = (
    'it names a JSON file of retention fields, such as {"recent_days": 3, "best_k": 5, "pinned": ["run@1000"]} '
    f"(fields: {', '.join(RetentionResource.model_fields)})"
)
