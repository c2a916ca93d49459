"""torch.save files whose sizes torch.load would trust: refused before it runs.

``torch.load(weights_only=True)`` unpickles nothing hostile, but it allocates what a file
declares: a compressed zip entry inflates to its declared size, and the legacy format
allocates each storage first and fills only those its key list names. The DCP importer
refused the first already (``test_import_dcp_pieces``); a ``.pt`` import did neither.
"""

from __future__ import annotations

import io
import pickle
import zipfile

import pytest
import torch

from ckptflow import CkptflowError
from ckptflow.interop.importers import read_source
from support.cli import run_cli


def test_a_pt_file_with_a_compressed_entry_is_refused_unloaded(tmp_path, capsys):
    """66 KB on disk that torch.load would inflate to a 64 MiB tensor."""
    plain, bomb = tmp_path / "plain.pt", tmp_path / "bomb.pt"
    torch.save({"w": torch.zeros(64 << 20, dtype=torch.uint8)}, plain)
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(bomb, "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED  # the tensor's bytes
            zout.writestr(info.filename, zin.read(info.filename), compress_type=method)
    assert bomb.stat().st_size < 1 << 20
    code, _, err = run_cli(capsys, "import", tmp_path / "store", "--run", "r", "--step", 1, bomb)
    assert code == 2 and "data/0' compressed" in err and "Traceback" not in err, err
    assert not (tmp_path / "store" / "runs").exists()


def _legacy_without_storage_keys(path) -> None:
    """A legacy torch.save file whose trailing key list is empty: torch.load allocates the
    storage and never reads its bytes into it."""
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, path, _use_new_zipfile_serialization=False)
    blob = path.read_bytes()
    f = io.BytesIO(blob)
    for _ in range(3):  # magic, protocol, system info
        pickle.load(f)

    class Skim(pickle.Unpickler):
        def persistent_load(self, pid):
            return None

        def find_class(self, module, name):
            return lambda *args, **kwargs: None

    Skim(f).load()  # the object
    keys_at = f.tell()
    pickle.load(f)  # the storage keys
    path.write_bytes(blob[:keys_at] + pickle.dumps([], protocol=2) + blob[f.tell() :])


def test_a_legacy_format_file_is_refused_rather_than_imported_uninitialised(tmp_path):
    path = tmp_path / "legacy.pt"
    _legacy_without_storage_keys(path)
    assert torch.load(path, weights_only=True)["w"].shape == (4,)  # torch accepts it, unread
    with pytest.raises(CkptflowError, match=r"not a readable torch.save file: not in the zip format.*save it again"):
        read_source(path)


def test_a_zip_appended_to_legacy_bytes_is_refused(tmp_path):
    """zipfile finds a zip anywhere at the end; torch.load reads the legacy bytes in front."""
    legacy, good = tmp_path / "legacy.pt", tmp_path / "good.pt"
    _legacy_without_storage_keys(legacy)
    torch.save({"w": torch.ones(4)}, good)
    polyglot = tmp_path / "polyglot.pt"
    polyglot.write_bytes(legacy.read_bytes() + good.read_bytes())
    with pytest.raises(CkptflowError, match="does not start with a zip entry"):
        read_source(polyglot)


def test_a_plain_torch_save_file_still_imports(tmp_path):
    torch.save({"w": torch.arange(4.0)}, tmp_path / "ok.pt")
    state = read_source(tmp_path / "ok.pt").state
    assert torch.equal(state["model"]["w"], torch.arange(4.0))


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda pickled: pickled[:-5], "pickle exhausted before seeing STOP"),
        (lambda pickled: pickled[:-2] + b"hc" + pickled[-2:], "a pickle memo read of 99, never written"),
    ],
    ids=["cut-short", "a-memo-read-never-written"],
)
def test_a_damaged_pickle_in_torch_saves_zip_is_told_damaged_not_a_legacy_file(tmp_path, damage, why):
    """The zip is torch.save's, its pickle damaged: it was refused as 'not in the zip format
    torch.save has written since PyTorch 1.6' with the advice for a legacy-format file."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4), "l": [1, 2]}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    name = next(n for n in source.namelist() if n.endswith("/data.pkl"))
    with zipfile.ZipFile(tmp_path / "damaged.pt", "w", zipfile.ZIP_STORED) as out:
        for entry in source.namelist():
            out.writestr(entry, damage(source.read(entry)) if entry == name else source.read(entry))
    with pytest.raises(CkptflowError) as refused:
        read_source(tmp_path / "damaged.pt")
    message = str(refused.value)
    assert f"damaged.pt is damaged: its pickle {name} cannot be read ({why})" in message, message
    assert "zip format" not in message and "legacy" not in message, message


def test_state_dicts_of_nested_modules_and_their_optimizer_import(tmp_path):
    """A module's state_dict is an OrderedDict whose ``_metadata`` (each submodule's version,
    set by a BUILD) the walk allows only on an OrderedDict the pickle constructs: a real
    Transformer's, a BatchNorm's (version 2) in nested Sequentials, and AdamW's state import."""
    torch.manual_seed(0)
    model = torch.nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16)
    nested = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Sequential(torch.nn.BatchNorm2d(2)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 2, 8), torch.randn(3, 2, 8)).sum().backward()
    optimizer.step()
    saved = {"model": model.state_dict(), "nested": nested.state_dict(), "optim": optimizer.state_dict()}
    assert saved["nested"]._metadata["1.0"]["version"] == 2
    torch.save(saved, tmp_path / "modules.pt")
    state = read_source(tmp_path / "modules.pt").state
    for part in ("model", "nested"):
        assert state[part].keys() == saved[part].keys()
        assert all(torch.equal(state[part][name], tensor) for name, tensor in saved[part].items())
    assert state["optim"]["param_groups"] == saved["optim"]["param_groups"]
    assert torch.equal(state["optim"]["state"][0]["exp_avg"], saved["optim"]["state"][0]["exp_avg"])


def test_a_state_holding_many_empty_containers_imports(tmp_path):
    """torch.save (pickle protocol 2) writes an empty list in 3 bytes with one memo entry
    (while the memo index is under 256): a bound of one memo write per 4 pickle bytes refused
    such a state as 'crafted or damaged' (150 empty per-worker queues beside a tensor: 667
    bytes, more than 166 writes)."""
    saved = {"w": torch.arange(4.0), "per_worker_queues": [[] for _ in range(150)], "seen": [{} for _ in range(3)]}
    torch.save(saved, tmp_path / "queues.pt")
    state = read_source(tmp_path / "queues.pt").state
    assert torch.equal(state["w"], saved["w"])
    assert state["per_worker_queues"] == saved["per_worker_queues"] and state["seen"] == saved["seen"]
