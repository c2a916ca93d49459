"""Saves after a process's first save or restore hash with BLAKE3 only the chunks whose bytes
changed, and stay exact.

An incremental save compares each chunk's fast checksum with what the same region of the
same tensor held at this process's previous save (or in the checkpoint it restored), and
reuses that save's address where they are equal. Every way of changing a tensor must still produce a checkpoint that
restores exactly: in place, through ``.data``, through a view, through another tensor or a
numpy array sharing its storage (none of which a version counter sees reliably), by
replacing it, resizing it, or ``load_state_dict`` into it; whether the save reads every
region or skips those the kernel saw no write to.
"""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import io as chunk_io
from ckptflow.chunks import private_copies
from ckptflow.dcp import written_pages
from ckptflow.format import layout as fmt
from support.corrupt import chunk_path, flip_byte

CHUNK = 256  # bytes: every tensor here spans several chunks


def _state() -> dict:
    torch.manual_seed(0)
    return {"model": nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8)), "buf": torch.randn(1000)}


def _in_place(state):
    with torch.no_grad():
        state["model"][0].weight.mul_(2)


def _through_data(state):
    state["model"][0].weight.data[3, 4] = 123.0


def _through_view(state):
    state["buf"].view(10, 100)[7, 50:60].fill_(-1.0)


def _through_shared_storage(state):
    alias = torch.empty(0).set_(state["buf"].untyped_storage(), 0, (1000,))
    alias[999] = 7.0


def _through_numpy(state):
    state["model"][1].bias.detach().numpy()[2] = 5.0


def _replaced(state):
    state["model"][0].weight = nn.Parameter(torch.randn(32, 32))
    state["buf"] = torch.randn(1000)


def _resized(state):
    state["buf"].resize_(1500)
    state["buf"].copy_(torch.arange(1500, dtype=torch.float32))


def _loaded_state_dict(state):
    torch.manual_seed(1)
    state["model"].load_state_dict(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8)).state_dict())


CHANGES = [
    _in_place,
    _through_data,
    _through_view,
    _through_shared_storage,
    _through_numpy,
    _replaced,
    _resized,
    _loaded_state_dict,
]


def _values(state: dict) -> dict:
    return {
        **{f"model.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()},
        "buf": state["buf"].clone(),
    }


def _blank_like(state: dict) -> dict:
    blank = {"model": copy.deepcopy(state["model"]), "buf": torch.zeros_like(state["buf"])}
    with torch.no_grad():
        for p in blank["model"].parameters():
            p.zero_()
    return blank


@pytest.fixture(params=["hashed", "page-tracked"])
def tracking(request, monkeypatch) -> bool:
    """Whether saves may skip reading regions the kernel saw no write to (``written_pages``),
    here for tensors of any size; else every region is read."""
    if request.param == "page-tracked":
        monkeypatch.setattr(written_pages, "MIN_TRACKED_BYTES", 0)
    return request.param == "page-tracked"


@pytest.mark.parametrize("kind", ["incremental", "full"])
@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_every_kind_of_change_restores_exactly(make_ck, change, blocking, kind, tracking):
    state = _state()
    ck = make_ck(chunk_bytes=CHUNK, track_writes=tracking)
    ck.save(1, state, kind="full", rng=False)
    ck.save(2, state, kind=kind, rng=False)  # nothing changed: every address (and, incremental, chunk) reused
    change(state)
    expected = _values(state)
    saved = ck.save(3, state, kind=kind, rng=False, blocking=blocking)
    if not blocking:
        saved.wait()
    change(state)  # changed again after the save: the checkpoint must hold the values at save time
    ck.wait()
    _assert_restores(make_ck, state, 3, expected, change)


def _assert_restores(make_ck, state: dict, step: int, expected: dict, change) -> None:
    fresh = _blank_like(state)
    make_ck(chunk_bytes=CHUNK).restore(fresh, step=step)
    got = _values(fresh)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{change.__name__}: {name} did not restore exactly"


@pytest.fixture
def hashed(monkeypatch) -> list[int]:
    """The lengths of the chunks a save computes a BLAKE3 address for, in order."""
    lengths: list[int] = []
    real, real_address, real_copy = chunk_io.address_and_checksum, chunk_io.address_of, private_copies.copy_and_hash

    def counting(raw):
        lengths.append(len(memoryview(raw).cast("B")))
        return real(raw)

    def counting_address(raw):  # a copy whose checksum is known, addressed anew
        lengths.append(len(memoryview(raw).cast("B")))
        return real_address(raw)

    def counting_copy(raw, into, *, address):  # a blocking save hashes what it copied
        if address:
            lengths.append(len(memoryview(raw).cast("B")))
        return real_copy(raw, into, address=address)

    monkeypatch.setattr(chunk_io, "address_and_checksum", counting)
    monkeypatch.setattr(chunk_io, "address_of", counting_address)
    monkeypatch.setattr(private_copies, "copy_and_hash", counting_copy)
    return lengths


def test_incremental_save_hashes_only_the_changed_chunks(make_ck, hashed):
    state = {"buf": torch.randn(4096), "frozen": torch.randn(4096)}  # 16 KiB each: 64 chunks each
    ck = make_ck(chunk_bytes=CHUNK)
    ck.save(1, state, kind="full", rng=False)
    assert sum(hashed) == 2 * 4096 * 4
    hashed.clear()
    state["buf"][100] += 1.0  # one chunk of one tensor
    info = ck.save(2, state, kind="incremental", rng=False).info
    assert hashed == [CHUNK]
    assert info.bytes_written == CHUNK
    fresh = {"buf": torch.zeros(4096), "frozen": torch.zeros(4096)}
    make_ck(chunk_bytes=CHUNK).restore(fresh, step=2)
    assert torch.equal(fresh["buf"], state["buf"]) and torch.equal(fresh["frozen"], state["frozen"])


def test_a_later_full_save_hashes_only_the_changed_chunks_and_rewrites_every_one(make_ck, hashed):
    state = {"buf": torch.randn(4096), "frozen": torch.randn(4096)}  # 16 KiB each: 64 chunks each
    ck = make_ck(chunk_bytes=CHUNK)
    ck.save(1, state, kind="full", rng=False)
    hashed.clear()
    state["buf"][100] += 1.0  # one chunk of one tensor
    info = ck.save(2, state, kind="full", rng=False).info
    assert hashed == [CHUNK]
    assert info.bytes_written == 2 * 4096 * 4  # a full save still writes every chunk
    fresh = {"buf": torch.zeros(4096), "frozen": torch.zeros(4096)}
    make_ck(chunk_bytes=CHUNK).restore(fresh, step=2)
    assert torch.equal(fresh["buf"], state["buf"]) and torch.equal(fresh["frozen"], state["frozen"])


@pytest.mark.parametrize("kind", ["incremental", "full"])
@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_every_kind_of_change_after_a_resume_restores_exactly(make_ck, change, kind, tracking):
    """A new process resumes (its Checkpointer knows only what the restore loaded), the
    state changes any way at all, and its first save still holds exactly the new values."""
    state = _state()
    make_ck(chunk_bytes=CHUNK).save(1, state, kind="full", rng=False)
    resumed = make_ck(chunk_bytes=CHUNK, track_writes=tracking)
    assert resumed.restore(state).step == 1
    change(state)
    expected = _values(state)
    resumed.save(2, state, kind=kind, rng=False)
    _assert_restores(make_ck, state, 2, expected, change)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_the_first_save_after_a_resume_hashes_only_the_changed_chunks_and_keeps_stored_checksums(
    make_ck, hashed, codec
):
    """What a restore loaded counts as the previous save: a resumed job's first incremental
    save computes BLAKE3 over the changed chunk only (it hashed all of them before), and the
    chunks it reuses keep the checksum of their stored bytes, which lets a restore of it
    check them without decoding them twice."""
    state = {"buf": torch.randn(4096), "frozen": torch.randn(4096)}
    make_ck(chunk_bytes=CHUNK, codec=codec).save(1, state, kind="full", rng=False)
    resumed = make_ck(chunk_bytes=CHUNK, codec=codec)
    resumed.restore(state)
    hashed.clear()
    state["buf"][100] += 1.0
    info = resumed.save(2, state, kind="incremental", rng=False).info
    assert hashed == [CHUNK] and info.bytes_written == CHUNK
    first, second = (catalog.read_manifest(resumed.store, "r", step) for step in (1, 2))
    if codec == "zstd":
        assert first.stored_checksums
        kept = {d: c for d, c in first.stored_checksums.items() if d in second.chunks}
        assert len(kept) == len(first.chunks) - 1 and kept.items() <= second.stored_checksums.items()
    fresh = {"buf": torch.zeros(4096), "frozen": torch.zeros(4096)}
    make_ck(chunk_bytes=CHUNK).restore(fresh, step=2)
    assert torch.equal(fresh["buf"], state["buf"]) and torch.equal(fresh["frozen"], state["frozen"])


@pytest.mark.parametrize("kind", ["incremental", "full"])
def test_a_step_saved_again_after_its_restore_was_refused_does_not_reuse_the_damaged_chunk(make_ck, kind):
    """Restore refuses step 2 (a chunk's bytes rotted) and falls back to 1; training replays
    deterministically and saves step 2 again: its chunks have the same addresses, so the
    save finds the damaged object in the store. It must write that chunk anew, not reuse it."""

    def state(step):
        torch.manual_seed(step)
        return {"w": torch.randn(4096)}

    ck = make_ck(chunk_bytes=CHUNK)
    ck.save(1, state(1), kind="full", rng=False)
    ck.save(2, state(2), kind="incremental", rng=False)
    one, two = (catalog.read_manifest(ck.store, "r", step) for step in (1, 2))
    victim = sorted(set(two.chunks) - set(one.chunks))[0]
    flip_byte(chunk_path(ck.store.root, victim), -1)
    resumed = make_ck(chunk_bytes=CHUNK)
    assert resumed.restore({"w": torch.zeros(4096)}).step == 1
    resumed.save(2, state(2), kind=kind, rng=False)
    fresh = {"w": torch.zeros(4096)}
    assert make_ck().restore(fresh).step == 2
    assert torch.equal(fresh["w"], state(2)["w"])
    assert resumed.verify(2, deep=True).ok


@pytest.mark.parametrize("kind", ["incremental", "full"])
def test_damage_found_by_another_process_is_written_anew_by_the_next_save(make_ck, ckpt_store_dir, kind):
    """A frozen tensor's chunk rots; ``ckptflow verify``, run by an operator in another
    process, finds it. The training job never read it, and its incremental saves keep the
    previous save's chunks without looking: unless it learns of the damage from the store,
    every checkpoint it writes references the rotten object, and a crash before the next
    full save leaves nothing to restore. Its next save writes the chunk anew, which repairs
    every checkpoint sharing it, and the damage record goes with the repair."""
    torch.manual_seed(0)
    state = {"frozen": torch.randn(4096), "head": torch.randn(64)}
    ck = make_ck(chunk_bytes=CHUNK)
    ck.save(1, state, kind="full", rng=False)
    state["head"] += 1.0
    ck.save(2, state, kind="incremental", rng=False)
    items = catalog.read_manifest(ck.store, "r", 2).items()
    frozen = next(item for item in items if item.fqn == "frozen").chunks[5][0]
    flip_byte(chunk_path(ckpt_store_dir, frozen), -1)
    verify = subprocess.run(
        [sys.executable, "-m", "ckptflow", "verify", ckpt_store_dir, "--run", "r", "--all"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert (Path(ckpt_store_dir) / fmt.damaged_key(frozen)).is_file()
    state["head"] += 1.0
    ck.save(3, state, kind=kind, rng=False)
    for step in (1, 2, 3):  # one rewrite repaired the chunk for every checkpoint sharing it
        assert make_ck().verify(step, deep=True).ok
    fresh = {"frozen": torch.zeros(4096), "head": torch.zeros(64)}
    assert make_ck().restore(fresh).step == 3
    assert torch.equal(fresh["frozen"], state["frozen"]) and torch.equal(fresh["head"], state["head"])
    assert not (Path(ckpt_store_dir) / fmt.damaged_key(frozen)).exists()


def test_a_delta_on_a_base_proved_damaged_is_stored_plainly_by_the_next_save(make_ck, ckpt_store_dir):
    """Codec "auto" stored step 2's chunk as a delta on step 1's; that base rots and scrub
    finds it (step 1 only: the delta itself is never read). The job no longer holds the
    base's content, so it cannot repair it, but its next incremental save must not keep a
    chunk that depends on it: it stores that chunk plainly. (Step 2 stays unrestorable: its
    manifest lists the base among its chunks.)"""
    torch.manual_seed(0)
    w = torch.randn(4096)
    ck = make_ck(chunk_bytes=4096, codec="auto")
    ck.save(1, {"w": w}, kind="full", rng=False)
    w += 1e-4 * torch.randn(4096)  # a layer that then stops changing
    ck.save(2, {"w": w}, kind="incremental", rng=False)
    delta, base = min(catalog.read_manifest(ck.store, "r", 2).bases.items())
    flip_byte(chunk_path(ckpt_store_dir, base), -1)
    assert not make_ck().verify(1, deep=True).ok  # what scrub does: it records the base
    ck.save(3, {"w": w}, kind="incremental", rng=False)
    assert delta not in catalog.read_manifest(ck.store, "r", 3).bases
    assert make_ck().verify(3, deep=True).ok
    fresh = {"w": torch.zeros(4096)}
    assert make_ck().restore(fresh).step == 3 and torch.equal(fresh["w"], w)
