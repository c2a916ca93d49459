"""A pickle's memo writes are bounded by its own size, before the walk keeps them all.

The walk (``pickle_walk.count_built``) keeps ~84 bytes per memo entry, and MEMOIZE is one
byte: a .pt of 32 million of them after one empty dict, within the objects bound, took the
import 2.7 GB and 70 s to walk before anything was refused. torch.save writes one memo entry
per ~11 bytes and DCP's metadata one per ~8.3, so more than one per
``MEMO_BYTES_PER_ENTRY`` bytes is refused as the walk reaches it.
"""

from __future__ import annotations

import io
import pickletools
import tracemalloc
import zipfile

import pytest
import torch

from ckptflow.errors import CkptflowError, DcpFormatError
from ckptflow.interop import importers, pickle_walk, torch_files

WRITES = 200_000


def _crafted_pickle() -> bytes:
    return b"\x80\x02}" + b"\x94" * WRITES + b"."  # an empty dict, MEMOIZE..., STOP


def test_a_torch_file_writing_more_memo_entries_than_its_bytes_allow_is_refused_before_walking_them(tmp_path):
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(tmp_path / "memo.pt", "w", zipfile.ZIP_STORED) as out:
        for name in source.namelist():
            out.writestr(name, _crafted_pickle() if name.endswith("/data.pkl") else source.read(name))
    size = len(_crafted_pickle())
    tracemalloc.start()
    try:
        with pytest.raises(CkptflowError) as refused:
            torch_files.check_plain_zip(tmp_path / "memo.pt", "memo.pt")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    most = size // pickle_walk.MEMO_BYTES_PER_ENTRY
    assert f"memo.pt writes more than {most} memo entries in a pickle of {size} bytes" in str(refused.value)
    assert "refused before torch.load runs its pickle" in str(refused.value)
    assert peak < 40 * WRITES  # all of them would take ~84 bytes each
    with pytest.raises(CkptflowError, match="memo entries in a pickle of"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "memo.pt")
    assert not (tmp_path / "store" / "runs").exists()


def test_dcp_metadata_writing_more_memo_entries_than_its_bytes_allow_is_refused(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x04}" + b"\x94" * WRITES + b".")
    with pytest.raises(DcpFormatError, match=r"\.metadata writes more than \d+ memo entries in a pickle of") as refused:
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "dcp")
    assert "refused before it is unpickled" in str(refused.value)


def test_a_real_transformer_state_dict_writes_far_fewer_memo_entries_than_the_bound(tmp_path):
    model = torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32)
    torch.save(model.state_dict(), tmp_path / "transformer.pt")
    with zipfile.ZipFile(tmp_path / "transformer.pt") as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    writes = sum(op.name in ("BINPUT", "LONG_BINPUT", "MEMOIZE") for op, _, _ in pickletools.genops(pickled))
    assert writes * 2 * pickle_walk.MEMO_BYTES_PER_ENTRY < len(pickled)  # at least twice the margin
    result = importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "transformer.pt")
    assert result.tensors == len(model.state_dict())
