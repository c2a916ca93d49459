"""codec="auto": chunks of incremental saves stored as XOR deltas against the newest full.

Bit-exact round trips of every dtype; the manifest lists every base it needs (also for
chunks reused without rewriting); GC keeps a base while any live manifest needs it and
frees it with the last; a corrupt base fails every delta on it (verify, restore falls
back); a restore reads nothing but its manifest's chunks; compaction and archival keep
the chain one link long.
"""

import pytest
import torch

from ckptflow import Checkpointer, CorruptChunkError, ManifestError, SavePolicy, gc, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import codecs
from ckptflow.chunks.io import ChunkStore
from ckptflow.format import layout as fmt
from ckptflow.store import open_store
from support.corrupt import corrupt_chunk, reseal_manifest
from support.faulty_store import FaultyStore
from support.states import DRIFT_CHUNK, assert_tensors_equal, blank_like, drifting_state

RUN = "d"


def _codec(store, digest: str) -> str:
    return codecs.header_codec(store.get(fmt.chunk_key(digest)))


def _save(root, steps, *, full_every=3, **kwargs):
    with Checkpointer(root, RUN, codec="auto", chunk_bytes=DRIFT_CHUNK, **kwargs) as ck:
        for step in steps:
            ck.save(step, drifting_state(step), kind="full" if step % full_every == 1 else "incremental")
    return open_store(root)


def _restore(root, step, **kwargs):
    target = blank_like(drifting_state(step))
    with Checkpointer(root, RUN, **kwargs) as ck:
        result = ck.restore(target, step=step)
    return target, result


@pytest.mark.parametrize("codec", ["raw", "zstd", "auto"])
def test_every_codec_round_trips_every_dtype_through_full_and_incremental_saves(ckpt_store_dir, codec):
    policy = SavePolicy(full_every=3, incremental_every=1)
    with Checkpointer(ckpt_store_dir, RUN, codec=codec, chunk_bytes=DRIFT_CHUNK, policy=policy) as ck:
        for step in range(1, 7):
            ck.save(step, drifting_state(step))
        for step in range(1, 7):
            assert ck.verify(step).ok
            target = blank_like(drifting_state(step))
            assert ck.restore(target, step=step).step == step
            assert_tensors_equal(drifting_state(step), target)


def test_weights_that_move_little_become_deltas_and_noise_does_not(ckpt_store_dir):
    store = _save(ckpt_store_dir, [1, 2])
    full, incr = (catalog.read_manifest(store, RUN, s) for s in (1, 2))
    assert full.bases == {} and not any(_codec(store, d) == "delta" for d in full.chunks)
    w = next(i for i in incr.items() if i.fqn == "model.w")
    noise = next(i for i in incr.items() if i.fqn == "noise")
    base_w = dict(next(i for i in full.items() if i.fqn == "model.w").chunks)
    assert {_codec(store, d) for d, _ in w.chunks} == {"delta"}
    assert {incr.bases[d] for d, _ in w.chunks} == set(base_w)  # the same slice of the full
    assert all(b in incr.chunks and incr.chunks[b] == incr.chunks[d] for d, b in incr.bases.items())
    assert {_codec(store, d) for d, _ in noise.chunks} <= {"zstd", "raw"}
    assert incr.stats.delta_chunks == len(incr.bases) > 0
    assert incr.stats.stored_written < 0.7 * incr.stats.bytes_written


def test_a_later_save_reusing_a_delta_chunk_lists_its_base_too(ckpt_store_dir):
    """Step 5 holds exactly step 2's weights (a rollback): their chunks already exist as
    deltas on step 1's chunks, are reused without rewriting, and step 5 must list step
    1's chunks although its own newest full is step 4."""
    with Checkpointer(ckpt_store_dir, RUN, codec="auto", chunk_bytes=DRIFT_CHUNK) as ck:
        ck.save(1, drifting_state(1), kind="full")
        ck.save(2, drifting_state(2), kind="incremental")
        ck.save(4, drifting_state(4), kind="full")
        ck.save(5, drifting_state(2), kind="incremental")
    store = open_store(ckpt_store_dir)
    two, five = catalog.read_manifest(store, RUN, 2), catalog.read_manifest(store, RUN, 5)
    reused = {d: b for d, b in two.bases.items() if d in five.chunks}
    assert reused and all(five.bases.get(d) == b and b in five.chunks for d, b in reused.items())
    for step in (1, 2, 4):  # retention expires everything else; GC runs
        lifecycle.expire(store, RUN, step)
    report = gc(store, grace=0)
    assert not {fmt.chunk_key(b) for b in reused.values()} & {k for k, _ in report.deleted}
    target, _ = _restore(ckpt_store_dir, 5)
    assert_tensors_equal(drifting_state(2), target)


def test_a_stored_delta_whose_base_is_gone_is_written_anew_when_reused(ckpt_store_dir):
    store = _save(ckpt_store_dir, [1, 2])
    two = catalog.read_manifest(store, RUN, 2)
    for base in set(two.bases.values()):
        store.delete(fmt.chunk_key(base))  # as if a GC had taken the base but not the delta
    for step in (1, 2):
        store.delete(fmt.manifest_key(RUN, step))
    with Checkpointer(ckpt_store_dir, RUN, codec="auto", chunk_bytes=DRIFT_CHUNK) as ck:
        ck.save(3, drifting_state(3), kind="full")
        ck.save(4, drifting_state(2), kind="incremental")  # step 2's content again
    four = catalog.read_manifest(store, RUN, 4)
    assert not set(two.bases.values()) & set(four.chunks)
    assert set(two.bases) & set(four.chunks)  # the same chunks, stored again
    assert Checkpointer(ckpt_store_dir, RUN).verify(4).ok
    target, _ = _restore(ckpt_store_dir, 4)
    assert_tensors_equal(drifting_state(2), target)


def test_gc_keeps_bases_of_live_deltas_and_frees_them_with_the_last_reference(ckpt_store_dir):
    store = _save(ckpt_store_dir, [1, 2, 3])
    bases = set(catalog.read_manifest(store, RUN, 2).bases.values()) | set(
        catalog.read_manifest(store, RUN, 3).bases.values()
    )
    assert bases
    store.delete(fmt.manifest_key(RUN, 1))  # the full itself expires; its chunks still serve as bases
    gc(store, grace=0)
    assert all(store.exists(fmt.chunk_key(b)) for b in bases)
    target, _ = _restore(ckpt_store_dir, 3)
    assert_tensors_equal(drifting_state(3), target)
    store.delete(fmt.manifest_key(RUN, 2))
    gc(store, grace=0)
    assert all(store.exists(fmt.chunk_key(b)) for b in bases)  # step 3 still needs them
    store.delete(fmt.manifest_key(RUN, 3))
    deleted = {k for k, _ in gc(store, grace=0).deleted}
    assert {fmt.chunk_key(b) for b in bases} <= deleted and not list(store.list("chunks/"))


def test_a_corrupt_base_fails_every_delta_on_it_and_restore_falls_back(ckpt_store_dir):
    store = _save(ckpt_store_dir, [1, 4, 5], full_every=3)  # 1 and 4 full, 5 deltas on 4
    five = catalog.read_manifest(store, RUN, 5)
    one = set(catalog.read_manifest(store, RUN, 1).chunks)
    base = next(b for b in five.bases.values() if b not in one)
    on_it = [d for d, b in five.bases.items() if b == base]
    corrupt_chunk(ckpt_store_dir, RUN, 4, base)
    with Checkpointer(ckpt_store_dir, RUN) as ck:
        report = ck.verify(5)
        assert not report.ok
        for delta in on_it:  # each delta on the base names its own failure
            assert any(delta[:2] in p and "delta base" in p for p in report.problems), report.problems
        assert not ck.verify(4).ok and ck.verify(1).ok
        target = blank_like(drifting_state(1))
        result = ck.restore(target)
    assert result.step == 1 and [s for s, _ in result.skipped] == [5, 4]
    assert "delta base" in result.skipped[0][1]
    assert_tensors_equal(drifting_state(1), target)


def test_restore_of_a_delta_checkpoint_reads_only_its_manifests_chunks(ckpt_store_dir):
    store = _save(ckpt_store_dir, [1, 2, 3, 4, 5])  # 5 deltas on 4; 1-3 hold other chunks
    manifest = catalog.read_manifest(store, RUN, 5)
    spy = FaultyStore(open_store(ckpt_store_dir), count_reads=True)
    target = blank_like(drifting_state(5))
    with Checkpointer(spy, RUN) as ck:
        assert ck.restore(target, step=5).step == 5
    read = {key.rsplit("/", 1)[-1] for _, op, key in spy.log if op == "get" and key.startswith("chunks/")}
    assert read <= set(manifest.chunks)
    assert set(manifest.bases.values()) <= read  # the bases were needed, and listed
    assert_tensors_equal(drifting_state(5), target)


def test_a_delta_whose_base_the_manifest_does_not_list_is_refused(ckpt_store_dir):
    store = _save(ckpt_store_dir, [1, 2])
    bases = set(catalog.read_manifest(store, RUN, 2).bases.values())

    def drop_bases(record):
        for digest in bases:
            record["chunks"].pop(digest, None)
        record.pop("bases")

    reseal_manifest(ckpt_store_dir, RUN, 2, drop_bases)
    report = Checkpointer(ckpt_store_dir, RUN).verify(2)
    assert not report.ok and any("not among the chunks the manifest lists" in p for p in report.problems)


@pytest.mark.parametrize(
    "mutate, why",
    [
        (lambda r: r["bases"].update({next(iter(r["bases"])): "ab" * 32}), "not listed"),
        (lambda r: r["bases"].update({b: d for d, b in list(r["bases"].items())[:1]}), "itself a delta"),
    ],
)
def test_manifest_bases_are_validated(ckpt_store_dir, mutate, why):
    _save(ckpt_store_dir, [1, 2])
    reseal_manifest(ckpt_store_dir, RUN, 2, mutate)
    with pytest.raises(ManifestError, match=why):
        catalog.read_manifest(open_store(ckpt_store_dir), RUN, 2)


def test_compaction_and_archival_keep_chains_one_link_long(ckpt_store_dir, tmp_path):
    store = _save(ckpt_store_dir, [1, 2])
    full, incr = (catalog.read_manifest(store, RUN, s) for s in (1, 2))
    for step in (1, 2):
        lifecycle.compress(store, RUN, step)
    assert all(_codec(store, d) != "delta" for d in full.chunks)  # a base never becomes a delta
    assert all(_codec(store, d) == "delta" for d in incr.bases)  # deltas stay deltas
    archive = open_store(str(tmp_path / "archive"))
    report = lifecycle.archive(store, archive, RUN, 2)
    assert report.ok, report.problems
    assert all(archive.exists(fmt.chunk_key(b)) for b in incr.bases.values())
    target, result = _restore(str(tmp_path / "archive"), 2)
    assert result.step == 2
    assert_tensors_equal(drifting_state(2), target)


def test_a_base_that_is_itself_a_delta_is_refused(ckpt_store_dir):
    store = _save(ckpt_store_dir, [1, 2])
    manifest = catalog.read_manifest(store, RUN, 2)
    delta, base = next(iter(manifest.bases.items()))
    store.replace(fmt.chunk_key(base), store.get(fmt.chunk_key(delta)))  # a delta where a base belongs
    with pytest.raises(CorruptChunkError, match="delta base is unusable.*cannot be a base itself"):
        ChunkStore(store).get(delta, manifest.chunks[delta])


def test_a_changed_tensor_layout_simply_stores_plainly(ckpt_store_dir):
    with Checkpointer(ckpt_store_dir, RUN, codec="auto", chunk_bytes=DRIFT_CHUNK) as ck:
        ck.save(1, {"w": torch.randn(1 << 15)}, kind="full")
        info = ck.save(2, {"w": torch.randn(1 << 14, 2)}, kind="incremental").info
    assert catalog.read_manifest(open_store(ckpt_store_dir), RUN, 2).bases == {}
    assert info.kind == "incremental"
