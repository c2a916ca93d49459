"""Exports of plain PyTorch models: fp16 refuses values it cannot hold, tied tensors are
written once (``safetensors.torch.load_model(strict=True)`` loads them), the same
checkpoint always gives the same bytes, the CLI writes a model directory, and only proof
of damage moves the export of "the newest checkpoint" to an older one. (int8 needs a
transformers config: ``test_export_int8_config``, ``test_export_hf``.)"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, load_model, save_file
from torch import nn

from ckptflow import Checkpointer
from ckptflow.errors import CkptflowError, ColdObjectError, StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.interop.export import (
    ExportOptions,
    export_dcp,
    export_safetensors,
    load_exported,
    model_metadata,
    tied_weights,
)
from ckptflow.interop.export.files import write_safetensors
from ckptflow.store import open_store
from support.cli import run_cli
from support.corrupt import chunk_path, flip_byte, only_in
from support.faulty_store import FaultyStore
from support.states import CHUNK, tagged_state


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight, and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def save(tmp_path, model: nn.Module, **metadata) -> str:
    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        ck.save(1, {"model": model}, metadata=metadata)
    return root


def test_fp16_refuses_out_of_range_values_naming_them(tmp_path):
    model = TiedLM()
    with torch.no_grad():
        model.embed.weight[0, 0] = 1e5
        model.norm.running_var[3] = 7e4
    root = save(tmp_path, model, **model_metadata(model))
    out = tmp_path / "m.safetensors"
    with pytest.raises(CkptflowError) as refused:
        export_safetensors(root, "r", out, options=ExportOptions(dtype="fp16"))
    message = str(refused.value)
    assert "'embed.weight' (max |x| 1e+05)" in message and "'norm.running_var' (max |x| 7e+04)" in message
    assert "head.weight" not in message  # written once, as embed.weight
    assert "bf16" in message and "--allow-fp16-overflow" in message
    assert not out.exists()
    # the same values in bf16 are fine; with the flag fp16 writes inf as asked
    export_safetensors(root, "r", out, options=ExportOptions(dtype="bf16"))
    assert load_file(str(out))["norm.running_var"][3].item() == pytest.approx(7e4, rel=1e-2)
    inf = tmp_path / "inf.safetensors"  # an export never replaces a file
    export_safetensors(root, "r", inf, options=ExportOptions(dtype="fp16", allow_fp16_overflow=True))
    assert load_file(str(inf))["embed.weight"][0, 0].isinf()


def test_bf16_refuses_values_beyond_its_range_too(tmp_path):
    """bf16's largest finite value (3.39e38) is just under fp32's: an fp32 value between
    the two became inf in the export, unchecked (fp16 alone was)."""
    model = TiedLM()
    with torch.no_grad():
        model.norm.running_var[3] = 3.4e38
    root = save(tmp_path, model, **model_metadata(model))
    out = tmp_path / "m.safetensors"
    with pytest.raises(CkptflowError, match=r"bf16 cannot hold 1 tensor.*'norm.running_var' \(max \|x\| 3.4e\+38\)"):
        export_safetensors(root, "r", out, options=ExportOptions(dtype="bf16", allow_fp16_overflow=True))
    assert not out.exists()
    export_safetensors(root, "r", out, options=ExportOptions(dtype="fp32"))
    assert load_file(str(out))["norm.running_var"][3].item() == pytest.approx(3.4e38)


def test_tied_weights_written_once_load_strictly(tmp_path):
    model = TiedLM()
    assert model_metadata(model) == {"tied_weights": [["embed.weight", "head.weight"]]}
    root = save(tmp_path, model, **model_metadata(model))
    out = tmp_path / "m.safetensors"
    export_safetensors(root, "r", out)
    assert "head.weight" not in load_file(str(out))
    fresh = TiedLM()
    assert load_model(fresh, str(out), strict=True) == (set(), [])
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    restored = TiedLM()
    restored.load_state_dict(load_exported(out), strict=True)  # ckptflow's loader restores the name
    assert torch.equal(restored.head.weight, model.embed.weight)


def test_recorded_ties_that_the_checkpoint_contradicts_are_refused(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    root = save(tmp_path, model, tied_weights=[["0.weight", "1.weight"]])  # not actually tied
    with pytest.raises(CkptflowError, match="holds different values"):
        export_safetensors(root, "r", tmp_path / "m.safetensors")


def test_equal_but_untied_tensors_are_both_written(tmp_path):
    """Equal bytes do not make a tie: two fresh BatchNorms hold identical tensors."""
    model = nn.Sequential(nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    assert tied_weights(model) == []
    root = save(tmp_path, model)
    export_safetensors(root, "r", tmp_path / "m.safetensors")
    assert load_model(nn.Sequential(nn.BatchNorm1d(4), nn.BatchNorm1d(4)), str(tmp_path / "m.safetensors")) == (
        set(),
        [],
    )


def test_export_is_deterministic(tmp_path):
    model = TiedLM()
    root = save(tmp_path, model, **model_metadata(model), config={"lr": 0.1}, data={"set": "x"})
    digests = []
    for i in range(2):
        out = tmp_path / f"dir{i}"
        result = export_safetensors(root, "r", out, options=ExportOptions(max_shard_bytes=300))
        digests.append({f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in result.files})
    assert digests[0] == digests[1] and len(digests[0]) > 3  # shards, index, card


def test_existing_directory_is_not_overwritten(tmp_path):
    root = save(tmp_path, TiedLM())
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(CkptflowError, match="already exists"):
        export_safetensors(root, "r", tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_cli_exports_a_model_directory(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    root = save(tmp_path, model, config={"lr": 0.01})
    out = tmp_path / "served"
    code, stdout, err = run_cli(capsys, "export", root, "--run", "r", "--out", out, "--dtype", "fp16")
    assert code == 0, err
    assert "README.md" in stdout and "model.safetensors" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors"]  # no model config recorded
    assert load_file(str(out / "model.safetensors"))["0.bias"].dtype == torch.float16
    card = (out / "README.md").read_text()
    assert "r@1" in card and '"lr": 0.01' in card and '"dtype": "fp16"' in card


class Outage:
    """Reads of the chosen chunks fail as a store that does not answer (or holds them cold)."""

    def __init__(self, root: str, error: type[StoreUnavailableError] = StoreUnavailableError):
        self.store, self.keys, self.error = FaultyStore(open_store(root)), set(), error
        self.store.fail_if = self.fail_if

    def fail_if(self, op: str, key: str) -> bool:
        if op == "get" and key in self.keys:
            raise self.error(f"S3 GetObject of {self.store.url}/{key} failed after 10 attempts: SlowDown")
        return False


def three_steps(tmp_path) -> str:
    root = str(tmp_path / "store")
    with Checkpointer(root, "a", chunk_bytes=CHUNK) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"model": tagged_state(step + 1)["model"]})
    return root


@pytest.mark.parametrize("error", [StoreUnavailableError, ColdObjectError])
def test_export_passes_over_damage_only_and_stops_at_what_it_could_not_read(tmp_path, error):
    root = three_steps(tmp_path)
    flip_byte(chunk_path(root, only_in(root, "a", 3, 1, 2)[0]))
    outage = Outage(root, error)
    unread = only_in(root, "a", 2, 1, 3)[0]
    outage.keys.add(fmt.chunk_key(unread))
    for export, out in ((export_safetensors, tmp_path / "m.safetensors"), (export_dcp, tmp_path / "dcp")):
        with pytest.raises(error) as refused:
            export(outage.store, "a", out)
        message = str(refused.value)
        assert "run 'a' step 2" in message and unread in message and "stopped rather than fall back" in message
        assert ("ckptflow thaw" in message) == (error is ColdObjectError)
        assert not out.exists() and not list(tmp_path.glob(f"{out.name}.tmp-*"))
        with pytest.raises(error, match=unread):  # the step named, but not readable: the same error
            export(outage.store, "a", out, step=2)
    outage.keys.clear()  # the store answers again: damage alone moves the export to an older step
    result = export_safetensors(outage.store, "a", tmp_path / "m.safetensors")
    assert result.step == 2 and [s for s, _ in result.skipped] == [3]
    assert "does not match its address" in result.skipped[0][1]
    assert export_dcp(outage.store, "a", tmp_path / "dcp").step == 2


def test_a_file_export_never_replaces_an_existing_file(tmp_path, capsys):
    """A directory export refused an existing non-empty directory, but ``--out x.safetensors``
    replaced an existing file silently: a deployed model lost. Now refused before any read."""
    root = save(tmp_path, TiedLM())
    out = tmp_path / "deployed.safetensors"
    save_file({"precious": torch.arange(5.0)}, out)
    before = out.read_bytes()
    with pytest.raises(CkptflowError, match="already exists; an export never replaces a file"):
        export_safetensors(root, "r", out, step=1)
    code, _, err = run_cli(capsys, "export", root, "--run", "r", "--step", 1, "--out", out)
    assert code == 2 and "already exists" in err and "Traceback" not in err, err
    assert out.read_bytes() == before


@pytest.mark.parametrize("target", ["empty", "nowhere"])
def test_an_export_to_a_symlink_is_refused_up_front(tmp_path, target):
    """A link to an empty directory or a dangling one passed the checks, and the export
    then failed after all its work with a bare ``[Errno 20] Not a directory``."""
    root = save(tmp_path, TiedLM())
    (tmp_path / "empty").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / target)
    for export in (
        lambda: export_safetensors(root, "r", link, step=1),
        lambda: export_dcp(root, "r", link, step=1),
    ):
        with pytest.raises(CkptflowError, match="is a symbolic link"):
            export()
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["empty", "link", "store"]


def test_every_dtype_safetensors_holds_exports_and_imports_back_exactly(tmp_path):
    """complex64 (a rotary freqs_cis buffer) and the fnuz float8 types were refused as dtypes
    "safetensors cannot hold", though the safetensors format holds them."""
    from ckptflow.interop.importers import import_checkpoint

    g = torch.Generator().manual_seed(0)
    tensors = {
        "freqs_cis": torch.polar(torch.ones(4, 2), torch.randn(4, 2, generator=g)),
        "f8fnuz": torch.randn(6, generator=g).to(torch.float8_e4m3fnuz),
        "f8e5fnuz": torch.randn(6, generator=g).to(torch.float8_e5m2fnuz),
        "bf16": torch.randn(3, generator=g).bfloat16(),
        "bool": torch.tensor([True, False]),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(2.5),
    }
    with Checkpointer(str(tmp_path / "store"), "r") as ck:
        ck.save(1, {"model": tensors})
    out = tmp_path / "m.safetensors"
    export_safetensors(str(tmp_path / "store"), "r", out, step=1)
    loaded = load_file(str(out))
    import_checkpoint(str(tmp_path / "again"), "r", 1, out)
    with Checkpointer(str(tmp_path / "again"), "r") as ck:
        _, state = ck.load(step=1)
    for copy in (loaded, state["model"]):
        assert sorted(copy) == sorted(tensors)
        for name, t in tensors.items():
            assert copy[name].dtype == t.dtype and copy[name].shape == t.shape, name
            assert copy[name].reshape(-1).view(torch.uint8).equal(t.reshape(-1).view(torch.uint8)), name
    with Checkpointer(str(tmp_path / "store"), "r") as ck:
        ck.save(2, {"model": {"w": torch.ones(2, dtype=torch.complex128)}})
    with pytest.raises(CkptflowError, match=r"complex128.*cannot hold: save it as one it can.*--format dcp"):
        export_safetensors(str(tmp_path / "store"), "r", tmp_path / "c128.safetensors", step=2)


def test_load_exported_reads_an_index_by_the_importers_rules(tmp_path):
    """load_exported read the files an index names with no check (one outside the directory
    was read; an index without weight_map raised KeyError); the importer refused both.
    One reader of an index now (files.weight_files) refuses both for either."""
    from ckptflow.interop.importers import read_source

    (tmp_path / "model").mkdir()
    save_file({"secret": torch.arange(3.0)}, tmp_path / "outside.safetensors")
    index = tmp_path / "model" / "model.safetensors.index.json"
    for doc, refusal in (
        ({"weight_map": {"secret": "../outside.safetensors"}}, "names files outside the directory"),
        ({"nope": 1}, "has no weight_map of tensor names to files"),
    ):
        index.write_text(json.dumps(doc))
        for read in (load_exported, read_source):
            with pytest.raises(CkptflowError, match=refusal):
                read(tmp_path / "model")


def test_a_file_made_at_the_path_during_an_export_is_not_replaced(tmp_path):
    """The export checks its path first, then writes; a file made there in between (another
    export, a deploy) was replaced by the final rename. Publishing by hard link refuses it."""
    out = tmp_path / "deployed.safetensors"
    save_file({"precious": torch.arange(5.0)}, out)  # made after the check, before the publish
    before = out.read_bytes()
    with pytest.raises(CkptflowError, match="appeared while the export was being written"):
        write_safetensors({"w": torch.ones(3)}, out, {})
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deployed.safetensors"]  # no temporary left


def test_a_tensor_with_an_empty_name_is_refused_not_dropped(tmp_path):
    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        ck.save(1, {"model": {"": torch.ones(2), "a": torch.zeros(1)}})
    out = tmp_path / "m.safetensors"
    with pytest.raises(CkptflowError, match="holds a tensor with an empty name under 'model'"):
        export_safetensors(root, "r", out)
    assert not out.exists()
