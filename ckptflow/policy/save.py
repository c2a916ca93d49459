"""Pure policy decisions: no storage, no clocks, trivially testable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptflow.policy.adaptive import AdaptivePolicy


@dataclass(frozen=True)
class SavePolicy:
    """Which kind of checkpoint (if any) to write at a step.

    Full checkpoints rewrite every chunk and so never depend on bytes written earlier;
    incremental ones write only chunks whose content the store does not hold yet.
    Both restore on their own.

    Full checkpoints are also where delta bases are (``codec="auto"``): a changed chunk
    of an incremental save may be stored as an XOR delta against the same slice of the
    newest full. So ``full_every`` bounds how far a delta reaches back (deltas grow
    with the distance: about 0.4x of raw one step after the full, more later) and how
    long a full's chunks outlive its own retention as bases.
    """

    full_every: int = 1000
    incremental_every: int | None = None

    def __post_init__(self) -> None:
        if self.full_every <= 0:
            raise ValueError(f"full_every must be positive, got {self.full_every}")
        if self.incremental_every is not None and self.incremental_every <= 0:
            raise ValueError(f"incremental_every must be positive or None, got {self.incremental_every}")

    @staticmethod
    def adaptive(*, max_overhead: float = 0.02, **options: Any) -> AdaptivePolicy:
        """A policy that measures save cost and step time online and moves the interval toward
        the model's optimum, save stalls held within ``max_overhead`` (``ckptflow.policy.adaptive``)."""
        from ckptflow.policy.adaptive import AdaptivePolicy

        return AdaptivePolicy(max_overhead=max_overhead, **options)

    def kind_for(self, step: int) -> str | None:
        if step % self.full_every == 0:
            return "full"
        if self.incremental_every and step % self.incremental_every == 0:
            return "incremental"
        return None
