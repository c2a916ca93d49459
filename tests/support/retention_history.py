"""Run histories as the store holds them after a week of the default retention: a run's
older cycles thinned to their fulls (for the advice's reading of the run's own interval)."""

from __future__ import annotations

from ckptflow import Checkpointer, SavePolicy, lifecycle, open_store
from ckptflow.policy.retention import DAY, default_policy
from ckptflow.reports import inventory
from support.states import RUN, tiny_state, tiny_train


def thinned_by_retention(
    root: str, policy: SavePolicy, *, last_week_from: int, best: int | None = None, steps: int = 101
) -> list[int]:
    """``steps`` steps saved under ``policy``, then what the default retention expires a week
    after step ``last_week_from`` expired: the steps deleted. With ``best``, that step has
    the lowest ``val_loss`` and retention keeps the best one (best-K, K=1)."""
    state = tiny_state()
    with Checkpointer(root, RUN, policy=policy) as ckpt:
        for step in range(steps):
            tiny_train(state)
            ckpt.save(step, state, metadata={"val_loss": 0.1 if step == best else 1.0})
    store = open_store(root)
    entries = inventory.collect(store)
    week_later = {e.step: e.created_at for e in entries}[last_week_from] + 7 * DAY
    plan = inventory.retention_plan(entries, week_later, policy=default_policy(best_k=0 if best is None else 1))
    for run, step in plan.delete:
        lifecycle.expire(store, run, step)
    return sorted(step for _, step in plan.delete)
