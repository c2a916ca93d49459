"""Issue 20, items 6 and 7 (DCP half): a DCP directory is imported only if its pieces tile
every tensor exactly, and nothing it declares is allocated beyond what its files hold.

Pieces that overlap, leave a gap, or reach outside their tensor would have left parts of
the imported tensor as uninitialised memory, committed as real weights; an item length
or a tensor shape the files cannot hold made the reader allocate it first. Both are
refused before anything is read, naming the file, the tensor and the region.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from ckptflow import Checkpointer
from ckptflow.errors import DcpFormatError
from ckptflow.interop.dcp_dir import read_state
from ckptflow.interop.importers import import_checkpoint
from support import dcp_plain_workers, dist_workers
from support.cli import run_cli

FULL = torch.arange(24, dtype=torch.float32).reshape(6, 4)


def _torch_saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def pieces_directory(directory: Path, pieces: list[tuple[int, int]], declared: list[tuple[int, int]] | None = None):
    """A DCP directory of ``FULL`` stored as row pieces ``(first row, rows)`` in one file,
    written as ``dcp.save`` writes the shards of a row-sharded tensor; ``declared``: the
    pieces ``.metadata`` claims, if not those stored."""
    dcp.save({"w": FULL}, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
    md = pickle.loads((directory / ".metadata").read_bytes())
    ((_, info),) = md.storage_data.items()
    stored = [(start, _torch_saved(FULL[start : start + rows].clone())) for start, rows in pieces]
    (directory / info.relative_path).write_bytes(b"".join(data for _, data in stored))
    md.state_dict_metadata["w"].chunks = [
        ChunkStorageMetadata(torch.Size([start, 0]), torch.Size([rows, 4])) for start, rows in declared or pieces
    ]
    md.storage_data, offset = {}, 0
    for start, data in stored:
        md.storage_data[MetadataIndex("w", torch.Size([start, 0]))] = type(info)(info.relative_path, offset, len(data))
        offset += len(data)
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    return directory


def rewrite_metadata(directory: Path, change) -> None:
    md = pickle.loads((directory / ".metadata").read_bytes())
    change(md)
    (directory / ".metadata").write_bytes(pickle.dumps(md))


def assert_refused_unchanged(tmp_path, directory: Path, match: str) -> None:
    with pytest.raises(DcpFormatError, match=match):
        import_checkpoint(str(tmp_path / "store"), "r", 1, directory)
    assert not (tmp_path / "store" / "runs").exists()  # nothing committed


# ---- item 6: exact coverage --------------------------------------------------------------
def test_overlapping_pieces_that_count_to_the_whole_tensor_are_refused(tmp_path):
    """Rows 0-2 and 2-4: 24 elements stored for 24, but row 5 written by nobody."""
    directory = pieces_directory(tmp_path / "dcp", [(0, 3), (2, 3)])
    assert_refused_unchanged(
        tmp_path,
        directory,
        r"\.metadata: tensor 'w' of shape \[6, 4\]: the piece at \[0, 0\] of size \[3, 4\] and the piece at "
        r"\[2, 0\] of size \[3, 4\] overlap in \[2:3, 0:4\]",
    )


def test_a_gap_between_pieces_is_refused_naming_it(tmp_path):
    directory = pieces_directory(tmp_path / "dcp", [(0, 3), (4, 2)])
    assert_refused_unchanged(
        tmp_path, directory, r"\.metadata: tensor 'w' of shape \[6, 4\]: no piece covers \[3:4, 0:4\]"
    )


def test_a_piece_reaching_outside_its_tensor_is_refused(tmp_path):
    """The metadata claims rows 3-6 of a 6-row tensor for a piece that holds rows 3-5."""
    directory = pieces_directory(tmp_path / "dcp", [(0, 3), (3, 3)], declared=[(0, 3), (3, 4)])
    assert_refused_unchanged(
        tmp_path, directory, r"tensor 'w' .*the piece at \[3, 0\] of size \[4, 4\] lies outside the tensor's shape"
    )


def test_a_stored_piece_of_another_shape_than_declared_is_refused(tmp_path):
    """The chunks tile the tensor, but the second item holds 2 rows where 3 are declared:
    row 5 would be left as it was allocated."""
    directory = pieces_directory(tmp_path / "dcp", [(0, 3), (3, 2)], declared=[(0, 3), (3, 3)])
    assert_refused_unchanged(tmp_path, directory, r"'w'.*holds a tensor of shape \[2, 4\], not the \[3, 4\] declared")


def test_a_piece_without_an_item_is_refused(tmp_path):
    directory = pieces_directory(tmp_path / "dcp", [(0, 3), (3, 3)])
    rewrite_metadata(directory, lambda md: md.storage_data.pop(MetadataIndex("w", torch.Size([3, 0]))))
    assert_refused_unchanged(tmp_path, directory, r"tensor 'w'.*the piece at \[3, 0\] has no stored item")


def test_hand_assembled_pieces_still_import_bit_exactly(tmp_path):
    directory = pieces_directory(tmp_path / "dcp", [(3, 3), (0, 1), (1, 2)])
    assert torch.equal(read_state(str(directory))["w"], FULL)
    out = {"w": torch.zeros(6, 4)}
    dcp.load(out, storage_reader=FileSystemReader(str(directory)), no_dist=True)  # DCP agrees
    assert torch.equal(out["w"], FULL)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_dtensors_saved_by_two_ranks_import_bit_exactly(tmp_path):
    """Real ``dcp.save`` by two gloo ranks of DTensors sharded along dimension 0, 1 and 2
    (uneven shards, one empty), a replicated tensor and a plain value."""
    session = dist_workers.launch(["save_plain"], tmp_path, registry=dcp_plain_workers.__name__)
    assert [r["rank"] for r in session.results("save_plain")] == [0, 1]
    directory = tmp_path / "save_plain" / "dcp"
    md = pickle.loads((directory / ".metadata").read_bytes())
    assert {fqn: len(md.state_dict_metadata[fqn].chunks) for fqn in ("rows", "cols", "cube", "tiny", "rep")} == {
        "rows": 2, "cols": 2, "cube": 2, "tiny": 2, "rep": 1}  # fmt: skip
    assert [list(c.sizes) for c in md.state_dict_metadata["tiny"].chunks] == [[1, 3], [0, 3]]

    import_checkpoint(str(tmp_path / "store"), "r", 1, directory)
    with Checkpointer(str(tmp_path / "store"), run="r") as ck:
        _, state = ck.load()
    for name, full in dcp_plain_workers.full_state().items():
        got = state[name]
        assert got.dtype == full.dtype and got.shape == full.shape, name
        assert got.contiguous().view(torch.uint8).equal(full.contiguous().view(torch.uint8)), name
    assert state["epoch"] == 7


# ---- item 7: allocations bounded by the files ----------------------------------------------
def _one_item(md):
    ((index, info),) = [(i, s) for i, s in md.storage_data.items() if i.fqn == "w"]
    return index, info


@pytest.mark.parametrize("length", [2**34, 2**50])
def test_an_item_longer_than_its_file_is_a_clean_error_with_bounded_memory(tmp_path, capsys, length):
    directory = tmp_path / "dcp"
    dcp.save({"w": torch.ones(1000)}, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
    rewrite_metadata(directory, lambda md: setattr(_one_item(md)[1], "length", length))
    tracemalloc.start()
    try:
        code, _, err = run_cli(capsys, "import", tmp_path / "store", "--run", "r", "--step", "1", directory)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 2 and peak < 64 << 20
    assert f"'w' claims bytes 0..{length} of" in err and "__0_0.distcp, which has" in err
    assert not (tmp_path / "store" / "runs").exists()


def test_a_shape_larger_than_the_files_is_refused_before_allocating(tmp_path, capsys):
    """A 4 GiB float32 tensor declared over a file of a few hundred bytes."""
    directory = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2, 2)}, storage_writer=FileSystemWriter(str(directory)), no_dist=True)

    def huge(md):
        n = 1 << 15
        md.state_dict_metadata["w"].size = torch.Size([n, n])
        md.state_dict_metadata["w"].chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([n, n]))]

    rewrite_metadata(directory, huge)
    code, _, err = run_cli(capsys, "import", tmp_path / "store", "--run", "r", "--step", "1", directory)
    assert code == 2
    assert "the piece of 'w' at [0, 0] of size [32768, 32768] needs 4294967296 bytes" in err
    assert "its item holds" in err and "Traceback" not in err


def test_items_sharing_bytes_of_a_file_are_refused(tmp_path):
    """Two pieces read from the same bytes would let the files back more tensor than they hold."""
    directory = pieces_directory(tmp_path / "dcp", [(0, 3), (3, 3)])

    def same_bytes(md):
        infos = sorted(md.storage_data.values(), key=lambda i: i.offset)
        infos[1].offset = infos[0].offset

    rewrite_metadata(directory, same_bytes)
    assert_refused_unchanged(tmp_path, directory, r"items of 'w' and 'w' share bytes .* of .*\.distcp")


RSS_PROBE = """
import json, sys
from ckptflow.interop.importers import read_source
def memory(field):  # VmHWM: peak resident set of this process (ru_maxrss would count its forked parent's)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
before = memory("VmRSS")
try:
    read_source(sys.argv[1])
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({"growth": memory("VmHWM") - before, "error": error}))
"""


def directory_with_object_item(directory: Path, data: bytes) -> Path:
    """A DCP directory whose non-tensor item ``obj`` is ``data``."""
    dcp.save({"w": torch.ones(3), "obj": "shard-7"}, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
    md = pickle.loads((directory / ".metadata").read_bytes())
    ((_, info),) = [(i, s) for i, s in md.storage_data.items() if i.fqn == "obj"]
    path = directory / info.relative_path
    info.offset, info.length = path.stat().st_size, len(data)
    with open(path, "ab") as f:
        f.write(data)
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    return directory


def probe_read(directory: Path) -> dict:
    """``read_source(directory)`` in a fresh process: its error and peak memory growth."""
    probe = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(directory)], capture_output=True, text=True, check=True
    )
    return json.loads(probe.stdout)


def test_a_compressed_item_that_expands_is_refused_with_bounded_memory(tmp_path):
    """A 256 KiB non-tensor item that torch.load would inflate to 256 MiB: torch.save never
    compresses, so any compressed entry is refused before loading."""
    plain = zipfile.ZipFile(io.BytesIO(_torch_saved(torch.zeros(256 << 20, dtype=torch.uint8))))
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w") as z:
        for name in plain.namelist():  # the tensor's bytes deflated, the rest stored as torch.save does
            z.writestr(name, plain.read(name), zipfile.ZIP_DEFLATED if "/data/" in name else zipfile.ZIP_STORED)
    del plain
    assert len(bomb.getvalue()) < 1 << 20
    result = probe_read(directory_with_object_item(tmp_path / "dcp", bomb.getvalue()))
    assert result["error"] and "'obj'" in result["error"] and "data/0' compressed" in result["error"], result
    assert result["growth"] < 96 << 20, result


def test_zip_entries_sharing_bytes_are_refused_with_bounded_memory(tmp_path):
    """64 storages of 2 MiB whose zip entries all point at the first one's bytes: a 2 MiB
    item that torch.load would turn into 128 MiB."""
    count, size = 64, 2 << 20
    saved = zipfile.ZipFile(io.BytesIO(_torch_saved([torch.zeros(size, dtype=torch.uint8) for _ in range(count)])))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name in saved.namelist():
            z.writestr(name, b"" if "/data/" in name and not name.endswith("/data/0") else saved.read(name))
    raw = bytearray(out.getvalue())
    first = zipfile.ZipFile(io.BytesIO(bytes(raw))).getinfo("archive/data/0").header_offset
    record = raw.find(b"PK\x01\x02")  # each central directory record: sizes at +20, header offset at +42
    while record != -1:
        name = raw[record + 46 : record + 46 + struct.unpack_from("<H", raw, record + 28)[0]].decode()
        if "/data/" in name and not name.endswith("/data/0"):
            struct.pack_into("<II", raw, record + 20, size, size)
            struct.pack_into("<I", raw, record + 42, first)
        record = raw.find(b"PK\x01\x02", record + 4)
    assert len(raw) < 3 << 20
    result = probe_read(directory_with_object_item(tmp_path / "dcp", bytes(raw)))
    assert result["error"] and "'obj'" in result["error"] and "bytes of entries in its" in result["error"], result
    assert result["growth"] < 64 << 20, result


def test_more_shards_than_an_import_takes_are_refused_saying_shards_and_what_to_do(tmp_path, monkeypatch):
    """The refusal of a checkpoint of more pieces than ``MAX_NAMES`` (bound lowered to 2)
    ended 'Import it in parts, each a checkpoint of its own', which a sharded DCP checkpoint
    cannot be split into; it names the shards and says to load it with DCP if trusted."""
    from ckptflow.interop import source_files

    monkeypatch.setattr(source_files, "MAX_NAMES", 2)
    directory = pieces_directory(tmp_path / "dcp", [(0, 2), (2, 2), (4, 2)])
    with pytest.raises(DcpFormatError) as refused:
        import_checkpoint(str(tmp_path / "store"), "r", 1, str(directory))
    message = str(refused.value)
    assert "names 3 tensor pieces (shards" in message and "more than the 2 one import takes" in message, message
    assert "fewer tensors or shards" in message and "dcp.load it yourself" in message, message
    assert not (tmp_path / "store" / "runs").exists()
