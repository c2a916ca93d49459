"""An adaptive policy's measurements, the same on every rank.

``AdaptivePolicy.kind_for`` is asked at every step with no collective (a collective per
training step would cost more than the policy saves), so each rank must hold the same
policy state, or one rank enters a save's collectives that another skipped and both hang.
Each rank measures its own stall and step time, and these differ (a slower disk, a busier
host): every save's measurements are therefore replaced by the slowest rank's before the
policy sees them, which is also the stall the job as a whole paid, since the other ranks
wait for that one at the next collective.
"""

from __future__ import annotations

import torch.distributed as dist

from ckptflow.dcp.collectives import Group, new_gloo_group
from ckptflow.policy.adaptive import AdaptivePolicy


class AgreedPolicy:
    """Feeds ``policy`` the slowest rank's measurements of each save, on its own gloo group:
    an async save's collectives run on the save group in a background thread while this
    one runs, and two threads' collectives on one group can pair up differently on each rank."""

    def __init__(self, policy: AdaptivePolicy, saves: Group):
        self.policy = policy
        self.group = saves
        if saves.active:
            ranks = dist.get_process_group_ranks(saves.pg)
            if len(ranks) == dist.get_world_size():
                # every rank saves, so every rank makes this group: made as the save group is,
                # it is named alike on every rank. A local synchronization names a group by
                # how many this rank holds, which differs after a group some ranks are not in
                # (``new_group([0])``): each rank then waited for its peers under another name.
                pg = new_gloo_group()
            else:  # a subgroup's ranks alone make it
                pg = new_gloo_group(ranks, local_synchronization=True)
            self.group = Group(pg)

    def observe(self, step: int, *, blocked_s: float, step_time_s: float | None) -> None:
        measured = self.group.all_gather((blocked_s, step_time_s))
        step_times = [t for _, t in measured if t is not None]
        self.policy.observe(
            step, blocked_s=max(b for b, _ in measured), step_time_s=max(step_times) if step_times else None
        )
