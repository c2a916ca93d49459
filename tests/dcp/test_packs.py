"""Small tensors packed into shared chunks (``ckptflow.dcp.packs``): what is stored, what
restores, what a reader refuses."""

import json

import pytest
import torch

from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks.reads import ChunkReader
from ckptflow.cli import main as cli_main
from ckptflow.errors import ManifestError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from support.corrupt import chunk_path, flip_byte, manifest_path, reseal_manifest


def small_state(seed: int = 0) -> dict:
    """A layer stack's small tensors in several dtypes, plus one too large to pack."""
    g = torch.Generator().manual_seed(seed)
    model = {f"layer{i}.norm": torch.randn(96, generator=g) for i in range(40)}
    model |= {f"layer{i}.bias": torch.randn(24, generator=g).to(torch.bfloat16) for i in range(40)}
    model |= {
        "counts": torch.randint(0, 1 << 40, (7,), generator=g),
        "mask": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0),
        "big": torch.randn(64, 64, generator=g),  # 16 KiB: over a quarter of the 32 KiB packs below
    }
    return {"model": model}


def zeros_like(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}


def assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert a["model"][k].dtype == b["model"][k].dtype and torch.equal(a["model"][k], b["model"][k]), k


def packed_items(ck, step: int) -> dict[str, tuple[str, int]]:
    manifest = catalog.read_manifest(ck.store, "r", step)
    return {
        i.fqn.removeprefix("model."): (i.chunks[0][0], i.packed_at) for i in manifest.items() if i.packed_at is not None
    }


def stats(ck, step: int) -> tuple[int, int]:
    """(chunks, chunks written) of ``step``."""
    manifest = catalog.read_manifest(ck.store, "r", step)
    return manifest.stats.chunks, manifest.stats.chunks_written


@pytest.mark.parametrize("codec", ["raw", "zstd", "auto"])
def test_small_tensors_share_few_chunks_and_restore_exactly(make_ck, codec):
    ck = make_ck(chunk_bytes=1 << 20, pack_bytes=32 << 10, codec=codec)
    state = small_state()
    result = ck.save(1, state, rng=False)
    packed = packed_items(ck, 1)
    assert set(packed) == set(state["model"]) - {"big", "empty"}  # every small item, none other
    packs = {digest for digest, _ in packed.values()}
    small_bytes = sum(t.nbytes for k, t in state["model"].items() if k not in ("big", "empty"))
    assert len(packs) == -(-small_bytes // (32 << 10)) == 1  # 20 KiB of small tensors: one pack
    assert result.info.chunks == len(packs) + 1  # the packs and big's one chunk

    target = zeros_like(state)
    make_ck(chunk_bytes=1 << 20).restore(target, step=1)
    assert_same(target, state)


def test_packs_close_at_their_size_and_members_stay_whole(make_ck):
    ck = make_ck(chunk_bytes=1 << 20, pack_bytes=1024)
    state = {"model": {f"t{i}": torch.full((50,), float(i)) for i in range(30)}}  # 200 B each, 5 per pack
    ck.save(1, state, rng=False)
    manifest = catalog.read_manifest(ck.store, "r", 1)
    packed = packed_items(ck, 1)
    assert len({d for d, _ in packed.values()}) == 6
    for digest, at in packed.values():
        assert at + 200 <= manifest.chunks[digest] <= 1024
    target = {"model": {k: torch.zeros(50) for k in state["model"]}}
    ck.restore(target, step=1)
    assert_same(target, state)


def test_an_incremental_save_writes_only_the_pack_that_changed(make_ck):
    ck = make_ck(chunk_bytes=1 << 20, pack_bytes=4096)
    state = {"model": {f"t{i}": torch.randn(256) for i in range(16)}}  # 1 KiB each: 4 packs of 4
    ck.save(1, state, rng=False)
    state["model"]["t9"].add_(1)
    ck.save(2, state, kind="incremental", rng=False)
    assert stats(ck, 2) == (4, 1)
    before = packed_items(ck, 1)
    after = packed_items(ck, 2)
    changed = {k for k in after if after[k][0] != before[k][0]}
    assert changed == {"t8", "t9", "t10", "t11"}  # t9's pack, and nothing else

    ck.save(3, state, kind="incremental", rng=False)
    assert stats(ck, 3) == (4, 0)
    target = {"model": {k: torch.zeros(256) for k in state["model"]}}
    make_ck().restore(target, step=3)
    assert_same(target, state)


def test_a_full_save_after_a_restore_reuses_nothing_wrongly(make_ck):
    """A new process has no pack regions (a restore records none): it hashes its packs, and
    stores them where the store lost them."""
    ck = make_ck(chunk_bytes=1 << 20, pack_bytes=4096)
    state = {"model": {f"t{i}": torch.randn(256) for i in range(8)}}
    ck.save(1, state, rng=False)
    resumed = make_ck(chunk_bytes=1 << 20, pack_bytes=4096)
    resumed.restore(state, step=1)
    for digest in {d for d, _ in packed_items(ck, 1).values()}:
        chunk_path(ck.store.root, digest).unlink()  # gone: the incremental below must write them
    resumed.save(2, state, kind="incremental", rng=False)
    assert stats(ck, 2) == (2, 2)
    assert cli_main(["verify", ck.store.root, "--run", "r", "--step", "2", "--deep"]) == 0


def test_pack_bytes_zero_stores_each_tensor_alone(make_ck):
    ck = make_ck(chunk_bytes=1 << 20, pack_bytes=0)
    state = small_state()
    result = ck.save(1, state, rng=False)
    assert packed_items(ck, 1) == {}
    assert result.info.chunks == len(state["model"]) - 1  # all but the empty tensor, none alike


@pytest.mark.parametrize("single_pass", [False, True])
def test_a_pack_split_by_staging_flushes_is_read_once(make_ck, monkeypatch, single_pass):
    """Targets of another dtype are staged, and staging is flushed every 1 KiB here (half
    of a 2 KiB restore buffer): a flush between a pack's members does not read it again."""
    ck = make_ck(chunk_bytes=1 << 20, pack_bytes=4096, restore_buffer_bytes=2048)
    state = {"model": {f"t{i:02d}": torch.randn(64) for i in range(32)}}  # 2 packs of 16 members
    ck.save(1, state, rng=False)
    packs = set(packed_items(ck, 1).values())
    assert len({digest for digest, _ in packs}) == 2
    reads: list[str] = []
    for method in ("read_checked", "read_verified"):
        real = getattr(ChunkReader, method)

        def counted(self, first, *args, real=real):
            reads.append(first if isinstance(first, str) else first.digest)
            return real(self, first, *args)

        monkeypatch.setattr(ChunkReader, method, counted)
    target = {"model": {k: torch.zeros(64, dtype=torch.float64) for k in state["model"]}}
    ck.restore(target, single_pass=single_pass)
    assert sorted(reads) == sorted({digest for digest, _ in packs})
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v.double()), k


def test_damage_in_a_pack_falls_back_for_every_member(make_ck):
    ck = make_ck(chunk_bytes=1 << 20, pack_bytes=32 << 10)
    old = small_state(seed=1)
    ck.save(1, old, rng=False)
    state = small_state(seed=2)
    ck.save(2, state, rng=False)
    digest, _ = packed_items(ck, 2)["layer3.norm"]
    flip_byte(chunk_path(ck.store.root, digest), 100)
    target = zeros_like(state)
    result = make_ck().restore(target)
    assert result.step == 1 and [s for s, _ in result.skipped] == [2]
    assert_same(target, old)


@pytest.mark.parametrize(
    ("what", "mutate"),
    [
        ("beyond its pack", lambda ref, size: ref.__setitem__(2, size - ref[1] + 1)),
        ("a negative offset", lambda ref, size: ref.__setitem__(2, -1)),
        ("a pack not listed", lambda ref, size: ref.__setitem__(0, "0" * 64)),
        ("a boolean offset", lambda ref, size: ref.__setitem__(2, True)),
    ],
)
def test_a_slice_outside_its_pack_is_refused(make_ck, what, mutate):
    ck = make_ck(chunk_bytes=1 << 20, pack_bytes=4096)
    ck.save(1, {"model": {f"t{i}": torch.randn(64) for i in range(8)}}, rng=False)

    def bad(record):
        item = next(i for i in record["dcp"]["items"] if len(i["chunks"][0]) == 3)
        ref = item["chunks"][0]
        mutate(ref, record["chunks"][ref[0]])

    reseal_manifest(ck.store.root, "r", 1, bad)
    with pytest.raises(ManifestError, match="pack"):
        Manifest.parse(manifest_path(ck.store.root, "r", 1).read_bytes(), what)


def test_a_pack_larger_than_its_named_slices_is_refused(make_ck):
    """A reader allocates a pack's listed size: the manifest may not claim more than the
    bytes of the items it names in it."""
    ck = make_ck(chunk_bytes=1 << 20, pack_bytes=4096)
    ck.save(1, {"model": {f"t{i}": torch.randn(64) for i in range(8)}}, rng=False)

    def bigger(record):
        item = next(i for i in record["dcp"]["items"] if len(i["chunks"][0]) == 3)
        record["chunks"][item["chunks"][0][0]] += 4096

    reseal_manifest(ck.store.root, "r", 1, bigger)
    with pytest.raises(ManifestError, match="name only"):
        Manifest.parse(manifest_path(ck.store.root, "r", 1).read_bytes(), "grown")


def test_a_pack_above_the_largest_any_save_writes_is_refused(make_ck):
    """A pack's members may lie in tensors a restore never asks for, so the slices it names
    do not bound what one member's restore allocates: no pack is above MAX_PACK_BYTES."""
    ck = make_ck(chunk_bytes=1 << 20, pack_bytes=4096)
    ck.save(1, {"model": {"b": torch.randn(8)}, "optim": {"x": torch.randn(8)}}, rng=False)
    huge = fmt.MAX_PACK_BYTES + 4

    def grown(record):  # optim.x "fills" a pack shared with model.b, as a hostile manifest may say
        b = next(i for i in record["dcp"]["items"] if i["fqn"] == "model.b")
        x = next(i for i in record["dcp"]["items"] if i["fqn"] == "optim.x")
        pack = b["chunks"][0][0]
        record["chunks"][pack] = huge
        b["chunks"] = [[pack, 32, 0]]
        x["chunks"], x["shape"] = [[pack, huge - 32, 32]], [(huge - 32) // 4]
        record["dcp"]["tensors"]["optim.x"].update(size=x["shape"], chunks=[{"offsets": [0], "sizes": x["shape"]}])

    reseal_manifest(ck.store.root, "r", 1, grown)
    with pytest.raises(ManifestError, match=f"no pack is larger than {fmt.MAX_PACK_BYTES}"):
        Manifest.parse(manifest_path(ck.store.root, "r", 1).read_bytes(), "grown")


@pytest.mark.parametrize("pack_bytes", [-1, fmt.MAX_PACK_BYTES + 1, True, 1.5])
def test_pack_bytes_out_of_range_is_refused(make_ck, pack_bytes):
    with pytest.raises(ValueError, match="pack_bytes must be a number of bytes up to 67108864"):
        make_ck(pack_bytes=pack_bytes)


def test_a_packed_ref_among_others_is_refused(make_ck):
    ck = make_ck(chunk_bytes=1 << 20, pack_bytes=4096)
    ck.save(1, {"model": {"a": torch.randn(64), "b": torch.randn(64)}}, rng=False)

    def two(record):
        item = record["dcp"]["items"][0]
        item["chunks"] = [item["chunks"][0], item["chunks"][0]]

    reseal_manifest(ck.store.root, "r", 1, two)
    with pytest.raises(ManifestError, match="chunk"):
        Manifest.parse(manifest_path(ck.store.root, "r", 1).read_bytes(), "two refs")


def test_the_manifest_names_each_slice_with_its_offset(make_ck):
    ck = make_ck(chunk_bytes=1 << 20, pack_bytes=4096)
    state = {"model": {"a": torch.randn(10), "b": torch.randn(20)}}
    ck.save(1, state, rng=False)
    record = json.loads(manifest_path(ck.store.root, "r", 1).read_bytes())
    refs = {i["fqn"]: i["chunks"] for i in record["dcp"]["items"]}
    (a,), (b,) = refs["model.a"], refs["model.b"]  # [pack, length, offset]
    assert a[0] == b[0] and (a[1], a[2], b[1], b[2]) == (40, 0, 80, 40)
    assert record["chunks"][a[0]] == 120
    assert record["format_version"] == 3  # a ckptflow that cannot read packs says to upgrade


def test_a_manifest_without_packs_keeps_format_2(make_ck):
    ck = make_ck(pack_bytes=0)
    ck.save(1, {"model": {"a": torch.randn(10)}}, rng=False)
    assert json.loads(manifest_path(ck.store.root, "r", 1).read_bytes())["format_version"] == 2
