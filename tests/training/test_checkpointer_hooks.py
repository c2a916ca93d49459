"""The three small Checkpointer additions the integrations and imports need:
``save(rng=False)``, ``load()`` freeing damaged steps for later saves (as ``restore``
does), and ``local=True`` (exercised for real by the Lightning ``ddp_spawn`` test)."""

from __future__ import annotations

import torch

from ckptflow.catalog import checkpoints as catalog
from support.corrupt import corrupt_chunk, only_in


def test_save_without_rng_stores_none_and_restores_none(make_ck):
    ck = make_ck()
    ck.save(1, {"w": torch.ones(2)}, rng=False)
    record = catalog.read_rank_record(ck.store, catalog.read_manifest(ck.store, "r", 1), 0)
    assert record.rng is None
    torch.manual_seed(7)
    before = torch.get_rng_state()
    assert not ck.restore({"w": torch.zeros(2)}).rng_restored
    assert torch.equal(torch.get_rng_state(), before)  # this process's RNG untouched


def test_load_falls_back_and_a_save_replaces_the_damaged_step(make_ck, ckpt_store_dir):
    ck = make_ck()
    ck.save(1, {"w": torch.ones(4)})
    ck.save(2, {"w": torch.full((4,), 2.0)})
    corrupt_chunk(ckpt_store_dir, "r", 2, only_in(ckpt_store_dir, "r", 2, 1)[0])
    again = make_ck()
    result, state = again.load()
    assert result.step == 1 and [s for s, _ in result.skipped] == [2]
    again.save(2, {"w": torch.full((4,), 3.0)})  # would raise CheckpointExistsError without the fix
    assert again.verify(2).ok and torch.equal(again.load(step=2)[1]["w"], torch.full((4,), 3.0))
