"""What a restore loaded, as the regions the next save compares against (``ckptflow.dcp.regions``)."""

from dataclasses import replace

import torch

from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks.io import UNKNOWN_SIZE
from ckptflow.dcp.metadata import metadata_from_index
from ckptflow.dcp.regions import loaded_regions


def test_regions_name_each_chunk_of_each_item_with_its_checksums_and_none_of_a_sha256_manifest(make_ck):
    ck = make_ck(chunk_bytes=1024, codec="zstd")
    ck.save(1, {"w": torch.arange(1024, dtype=torch.float32), "b": torch.ones(8)}, rng=False)
    manifest = catalog.read_manifest(ck.store, "r", 1)
    items = list(metadata_from_index(manifest.dcp)[1].values())
    seen = loaded_regions(manifest, items)
    # "b" is packed (``ckptflow.dcp.packs``): a pack's region names all its members, so the next save hashes it
    assert [i.fqn for i in items if i.packed_at is not None] == ["b"]
    assert sorted((fqn, index, length) for fqn, _, index, _, length in seen) == [("w", i, 1024) for i in range(4)]
    for write in seen.values():
        assert write.checksum == manifest.fast_checksums[write.digest] and write.stored_bytes == UNKNOWN_SIZE
        assert write.stored_checksum == manifest.stored_checksums.get(write.digest, "")
    assert any(write.stored_checksum for write in seen.values())
    # chunks named by sha256 (format 1): reusing the names would put them under a BLAKE3 manifest
    assert loaded_regions(replace(manifest, address="sha256"), items) == {}
