"""Item 7 of issue 9: safetensors files, Hugging Face model directories and ``torch.save``
files brought in as checkpoints, and the ``ckptflow import`` / ``export --format dcp``
commands.

The HF round trip uses the real transformers: a tiny GPT-2 built from a config (nothing
downloaded) saved with ``save_pretrained`` (which drops the tied ``lm_head.weight``),
imported, exported again as a model directory, and loaded with ``from_pretrained``: the
logits are bit-equal to the original model's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from ckptflow import Checkpointer, CkptflowError
from ckptflow.interop.export import export_safetensors
from ckptflow.interop.importers import detect_format, import_checkpoint
from support.child_env import child_env
from support.cli import run_cli
from support.states import tiny_state, tiny_train

REPO = Path(__file__).resolve().parents[2]


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # no two tensors equal by accident, as after training
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.arange(12).reshape(2, 6)


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_hf_directory_round_trip_gives_equal_logits(tmp_path, shard):
    model = gpt2()
    src = tmp_path / "hf"
    model.save_pretrained(src, **({"max_shard_size": shard} if shard else {}))
    assert os.path.exists(src / "model.safetensors.index.json") == bool(shard)
    store = str(tmp_path / "store")

    result = import_checkpoint(store, "gpt", 100, src)
    assert result.format == "hf" and result.entries == ["model"]

    with Checkpointer(store, run="gpt") as ck:
        live = {"model": gpt2(seed=1)}
        restored = ck.restore(live)  # strict: the tied name save_pretrained dropped is back
        assert restored.metadata["model_config"]["architectures"] == ["GPT2LMHeadModel"]
    assert torch.equal(logits(live["model"], IDS), logits(model, IDS))

    export_safetensors(store, "gpt", tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(logits(reloaded, IDS), logits(model, IDS))
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()  # still tied


def test_safetensors_file_imports_as_model_entry(tmp_path):
    state = tiny_state(0, optimizer=False)
    tensors = {k: v.detach().clone() for k, v in state["model"].state_dict().items()}
    save_file(tensors, tmp_path / "w.safetensors")
    import_checkpoint(str(tmp_path / "store"), "st", 1, tmp_path / "w.safetensors")
    live = tiny_state(1, optimizer=False)
    with Checkpointer(str(tmp_path / "store"), run="st") as ck:
        result = ck.restore(live)
    assert result.metadata["import"] == {"format": "safetensors", "source": str(tmp_path / "w.safetensors")}
    for name, tensor in live["model"].state_dict().items():
        assert torch.equal(tensor, tensors[name])


def test_an_import_tells_progress_every_byte_it_writes(tmp_path):
    tensors = {"w": torch.randn(3, 4096), "b": torch.randn(4096)}
    save_file(tensors, tmp_path / "w.safetensors")
    told: list[int] = []
    result = import_checkpoint(str(tmp_path / "store"), "st", 1, tmp_path / "w.safetensors", progress=told.append)
    assert told and sum(told) == result.bytes == 4 * 4 * 4096  # what `ckptflow import` shows on a terminal


def test_torch_file_training_checkpoint_imports_its_entries(tmp_path):
    state = tiny_state(0)
    tiny_train(state, 2)
    torch.save({"model": state["model"].state_dict(), "epoch": 4, "note": "from a .pt"}, tmp_path / "ckpt.pt")
    import_checkpoint(str(tmp_path / "store"), "pt", 1, tmp_path / "ckpt.pt")
    live = {**tiny_state(1, optimizer=False), "epoch": 0, "note": ""}
    with Checkpointer(str(tmp_path / "store"), run="pt") as ck:
        ck.restore(live)
    assert (live["epoch"], live["note"]) == (4, "from a .pt")
    for name, tensor in live["model"].state_dict().items():
        assert torch.equal(tensor, state["model"].state_dict()[name])


def test_torch_file_state_dict_imports_as_model_entry(tmp_path):
    model = tiny_state(0, optimizer=False)["model"]
    torch.save(model.state_dict(), tmp_path / "sd.pth")
    import_checkpoint(str(tmp_path / "store"), "pt", 1, tmp_path / "sd.pth")
    with Checkpointer(str(tmp_path / "store"), run="pt") as ck:
        _, state = ck.load()
    assert list(state) == ["model"] and all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())


class PlantsMarker:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def test_hostile_torch_file_is_refused_without_running(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"model": {"w": torch.ones(2)}, "evil": PlantsMarker(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(CkptflowError, match=r"evil.pt calls builtins.exec in its pickle.*never unpickles anything"):
        import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "evil.pt")
    assert not marker.exists()
    torch.load(tmp_path / "evil.pt", weights_only=False)  # what an unguarded loader does
    assert marker.exists()


STORAGES = [torch.arange(1 << 16, dtype=torch.float32) + i for i in range(4)]  # 256 KiB each


def deep(levels: int) -> dict:
    tree: dict = {"w": torch.zeros(1)}
    for _ in range(levels):
        tree = {"x": tree}
    return tree


@pytest.mark.parametrize(
    "name, content, expect",
    [
        ("junk.pt", b"hello world", "not a readable torch.save file"),
        ("expand.pt", {"w": torch.zeros(1).expand(20_000, 20_000)}, r"needs 1600000000 bytes, but the file stores 4"),
        ("deep.pt", deep(100), "nests deeper than 64 levels"),
        (
            "views.pt",  # four storages of 256 KiB, 256 overlapping slices of each
            {f"w{i}.{j}": storage[j:] for i, storage in enumerate(STORAGES) for j in range(256)},
            "its 1024 tensors claim 267913216 bytes together, but the file stores 1048576",
        ),
        ("meta.pt", {"w": torch.empty(1000, 1000, device="meta")}, "is on the meta device, with no data in the file"),
        (
            "sparse.pt",
            {"w": torch.eye(3).to_sparse()},
            "has layout torch.sparse_coo, which ckptflow cannot store",
        ),
        ("q.pt", {"w": torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8)}, "is quantized"),
    ],
)
def test_a_torch_file_that_is_not_a_plain_state_is_refused_before_anything_is_allocated(
    tmp_path, capsys, name, content, expect
):
    """Bad bytes, a 1.6 KB file claiming 1.6 GB through a stride-0 view, a state nested
    200 deep, tensors without data here: one clear error, exit 2, nothing written."""
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    code, out, err = run_cli(capsys, "import", tmp_path / "store", "--run", "r", "--step", 1, path)
    assert code == 2 and expect in err and "Traceback" not in err, err
    assert not (tmp_path / "store" / "runs").exists()


def test_views_a_real_state_holds_import_exactly(tmp_path):
    """A fused weight saved beside its slices, a tied weight, a transposed view, an
    expand() of a row (HF position_ids), an empty and a 0-dim tensor: within the bounds."""
    fused = torch.randn(12, 4)
    state = {
        "qkv": fused,
        "q": fused[:4],
        "k": fused[4:8],
        "v": fused[8:],
        "tied": fused,
        "t": fused.t(),
        "position_ids": torch.arange(16).expand((1, -1)),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(3.0),
    }
    torch.save(state, tmp_path / "views.pt")
    import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "views.pt")
    live = {"model": {k: torch.zeros_like(v).contiguous() for k, v in state.items()}}
    with Checkpointer(str(tmp_path / "store"), "r") as ck:
        ck.restore(live)
    assert all(torch.equal(live["model"][k], v) for k, v in state.items())


def test_a_safetensors_file_with_an_empty_tensor_imports(tmp_path):
    """safetensors gives each tensor a storage of its own, an empty one starting where the
    next begins: views are told apart by storage start and size, not start alone."""
    state = {"a_empty": torch.zeros(0), "b_weight": torch.ones(17 << 20)}  # 68 MiB: past the slack
    save_file(state, tmp_path / "w.safetensors")
    assert import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "w.safetensors").tensors == 2


def test_a_safetensors_file_holding_no_tensors_is_refused_as_an_empty_torch_file_is(tmp_path):
    save_file({}, tmp_path / "none.safetensors")
    with pytest.raises(CkptflowError, match="none.safetensors hold\\(s\\) no tensors: nothing to import"):
        import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "none.safetensors")
    assert not (tmp_path / "store" / "runs").exists()


def test_a_model_directory_whose_config_is_of_the_wrong_types_is_refused(tmp_path, capsys):
    model = gpt2()
    model.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for bad, expect in (({"architectures": 5}, "no 'architectures' entry"), ({"n_layer": "two"}, "does not build")):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **bad}))
        code, _, err = run_cli(capsys, "import", tmp_path / "store", "--run", "r", "--step", 1, tmp_path / "hf")
        assert code == 2 and expect in err and "Traceback" not in err, err
    for not_an_object in ("null", "[1, 2]"):  # no config read as none: refused, not imported without one
        (tmp_path / "hf" / "config.json").write_text(not_an_object)
        code, _, err = run_cli(capsys, "import", tmp_path / "store", "--run", "r", "--step", 1, tmp_path / "hf")
        assert code == 2 and "config.json is not a JSON object" in err, err


def test_unknown_source_names_what_is_supported(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CkptflowError, match=r"DCP checkpoint directory.*Hugging Face.*safetensors.*torch\.save"):
        detect_format(str(tmp_path / "notes.txt"))
    with pytest.raises(CkptflowError, match="does not exist"):
        detect_format(str(tmp_path / "missing"))


def test_hf_index_naming_a_file_outside_is_refused(tmp_path):
    model = gpt2()
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    index = tmp_path / "hf" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(CkptflowError, match="outside the directory"):
        import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "hf")


@pytest.mark.parametrize("source", ["hf shard", "safetensors", "torch"])
def test_a_fifo_among_the_files_is_refused_instead_of_blocking_the_import(tmp_path, source):
    """Opening a FIFO blocks until a writer comes: the import would hang without a word.
    The command runs in a process of its own, which the timeout ends if it blocks."""
    hf = tmp_path / "hf"
    hf.mkdir()
    fifo = {"hf shard": hf / "model-00001-of-00001.safetensors", "safetensors": tmp_path / "x.safetensors"}
    fifo_path = fifo.get(source, tmp_path / "x.pt")
    os.mkfifo(fifo_path)
    index = {"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    src, fmt = (hf, "auto") if source == "hf shard" else (fifo_path, source)
    command = [sys.executable, "-m", "ckptflow", "import", tmp_path / "store", "--run", "r", "--step", "1"]
    try:
        done = subprocess.run(
            [*map(str, command), "--format", fmt, str(src)],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(REPO),
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the import of {src} blocked on the FIFO {fifo_path}")
    assert done.returncode == 2, done.stderr
    assert f"{fifo_path} is not a regular file" in done.stderr and "import that" in done.stderr
    assert not (tmp_path / "store" / "runs").exists()


# ---- the command line -------------------------------------------------------------
def test_cli_import_then_export_dcp(tmp_path, capsys):
    model = gpt2()
    model.save_pretrained(tmp_path / "hf")
    store = tmp_path / "store"
    code, out, err = run_cli(capsys, "import", store, "--run", "gpt", "--step", 7, tmp_path / "hf")
    assert code == 0, err
    assert "as run gpt step 7" in out and "(hf)" in out

    code, out, err = run_cli(capsys, "export", store, "--run", "gpt", "--format", "dcp", "--out", tmp_path / "dcp")
    assert code == 0, err
    assert "step 7 (state, DCP)" in out
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(target, storage_reader=FileSystemReader(str(tmp_path / "dcp")), no_dist=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(target["model"][name], tensor), name

    code, _, err = run_cli(
        capsys, "export", store, "--run", "gpt", "--format", "dcp", "--dtype", "bf16", "--out", tmp_path / "x"
    )
    assert code == 2 and "--dtype apply to model exports" in err and not os.path.exists(tmp_path / "x")

    code, _, err = run_cli(capsys, "import", store, "--run", "gpt", "--step", 7, tmp_path / "hf")
    assert code == 2 and "already committed" in err


def test_a_model_config_declaring_more_than_its_files_hold_is_refused_before_it_is_built(tmp_path, capsys):
    """A 139-byte config.json with n_layer=5000 beside one tiny tensor: the import built the
    whole declared model on the meta device before comparing a tensor (20 s here; a million
    layers, an hour and tens of GB). Building now stops at twice the tensors the files hold
    (plus a slack), and says so."""
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"w": torch.ones(1)}, src / "model.safetensors", metadata={"format": "pt"})
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 5000, "n_embd": 8, "n_head": 2}
    (src / "config.json").write_text(json.dumps({**config, "vocab_size": 16, "bos_token_id": 0, "eos_token_id": 0}))
    code, _, err = run_cli(capsys, "import", tmp_path / "store", "--run", "r", "--step", 1, src)
    assert code == 2 and "declares a larger GPT2LMHeadModel than its files hold" in err, err
    assert not (tmp_path / "store" / "runs").exists()


def test_a_model_config_naming_a_hub_repository_is_refused_without_reaching_the_network(tmp_path, monkeypatch):
    """Reading tie groups builds the class config.json names; transformers resolves a
    ``backbone`` it names on the Hub while building the config (``repo_exists``), so an
    imported directory sent the importer to any repository it liked (a DNS lookup of
    huggingface.co here). Now the build runs with the Hub offline and says why it stopped."""
    import socket

    lookups: list = []

    def no_network(*args, **kwargs):
        lookups.append(args[:2])
        raise OSError("the test allows no network")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"w": torch.ones(1)}, src / "model.safetensors", metadata={"format": "pt"})
    config = {"architectures": ["DetrForObjectDetection"], "model_type": "detr", "use_timm_backbone": False}
    (src / "config.json").write_text(json.dumps({**config, "backbone": "someone/some-repo", "backbone_config": None}))
    with pytest.raises(CkptflowError, match="names something to fetch from the Hugging Face Hub.*someone/some-repo"):
        import_checkpoint(str(tmp_path / "store"), "r", 1, src)
    assert lookups == [] and not (tmp_path / "store" / "runs").exists()


def test_a_model_directory_of_a_class_transformers_does_not_ship_says_what_to_do(tmp_path):
    """A trust_remote_code model: no code from the directory is run, and the message says how to import anyway."""
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"w": torch.ones(1)}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"architectures": ["MyOwnModelForCausalLM"], "model_type": "mine"}))
    with pytest.raises(CkptflowError, match=r"no model class 'MyOwnModelForCausalLM'.*trust_remote_code.*without that"):
        import_checkpoint(str(tmp_path / "store"), "r", 1, src)
    assert not (tmp_path / "store" / "runs").exists()
