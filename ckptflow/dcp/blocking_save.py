"""A blocking save through DCP's planning and collectives, without ``dcp.save``'s pass
over the state's top-level keys.

``dcp.save`` first calls ``state_dict()`` on each ``Stateful`` value of the state, and
wraps each key's call in DCP's event logger, which builds a message and two log records
per key whether anything listens or not: 5 ms for 132 tensors, 128 ms for 2,400, on the
saving thread. ckptflow hands DCP the flattened tensors of ``state_tree.flatten``, where
no value is ``Stateful``, so that pass only copies the dict: this calls what comes after
it, ``_save_state_dict``, directly (torch is pinned; ``tests/dcp/test_blocking_save.py``
checks the two write the same checkpoint).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

from ckptflow.dcp.collectives import Group
from ckptflow.dcp.writer import CheckpointWriter


def save_tensors(tensors: dict[str, torch.Tensor], writer: CheckpointWriter, group: Group) -> None:
    """What ``dcp.save(tensors, storage_writer=writer, ...)`` does for a dict of tensors
    (not ``Stateful`` values: asking each is itself a slow ``isinstance`` of a protocol).
    The writer's lease goes back however the save ends (another rank's failure included)."""
    try:
        _save_state_dict(tensors, storage_writer=writer, process_group=group.pg, no_dist=not group.active)
    finally:
        writer.lease.release()
