"""The scrub job over a commit imported with ``allow_failed``: the verdict it carries is its
source's, not damage the scrub can repair or must report."""

import torch

from ckptflow import Checkpointer, lifecycle
from ckptflow.interop.export import export_safetensors
from ckptflow.interop.importers import import_checkpoint
from ckptflow.store import open_store
from support.corrupt import chunk_path, corrupt_chunk, flip_byte, tensor_chunk
from support.dagster import scrub_all


def exported_despite_a_failed_verdict(tmp_path) -> str:
    """A .safetensors file exported with ``allow_failed`` from a commit whose validation failed."""
    root = str(tmp_path / "source")
    with Checkpointer(root, "src") as ck:
        ck.save(1, {"model": {"w": torch.arange(64.0)}, "extra": torch.full((64,), 1.0)})
    damaged = chunk_path(root, tensor_chunk(root, "src", 1, "extra"))
    flip_byte(damaged)
    assert not lifecycle.validate(open_store(root), "src", 1)["ok"]
    flip_byte(damaged)  # repaired, not validated again: the verdict stands
    out = tmp_path / "failed.safetensors"
    export_safetensors(root, "src", out, step=1, allow_failed=True)
    return str(out)


def test_a_scrub_repairs_an_opt_in_import_from_the_archive_and_passes(
    store_with_checkpoints, defs, paths, instance, tmp_path
):
    """Scrub repairs a damaged chunk from the archive copy, then validates the commit again to
    see it whole: an opt-in import's new verdict keeps its carried failure, so it was never
    "whole again" and the job failed ("no tier held a sound copy of their damaged chunks")
    although the archive had repaired it."""
    store, archive_tier = open_store(store_with_checkpoints), open_store(paths["archive"])
    import_checkpoint(store, "imported", 5, exported_despite_a_failed_verdict(tmp_path), allow_failed=True)
    assert lifecycle.archive(store, archive_tier, "imported", 5).ok
    corrupt_chunk(store_with_checkpoints, "imported", 5)
    result = scrub_all(defs, instance, raise_on_error=False)
    assert result.success
    verdict = lifecycle.validate(store, "imported", 5)
    assert lifecycle.found_damage(verdict) == [] and verdict["ok"] is False  # whole; the carried verdict stands
