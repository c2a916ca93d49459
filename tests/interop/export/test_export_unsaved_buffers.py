"""Buffers a model does not save (``persistent=False``), carried by an imported file.

Older transformers wrote BERT's ``embeddings.position_ids`` into ``model.safetensors``
(all-MiniLM-L6-v2's file still holds it); today's ``BertModel`` registers it as a
non-persistent buffer, so it is not in the model's ``state_dict()``. Exporting such a
checkpoint used to be refused ("not in the config's model: embeddings.position_ids"): a
real model could not go import -> checkpoint -> model directory at all. The export now
writes what the model saves, as ``save_pretrained`` does, and names what it left out in the
header; the real ``from_pretrained`` loads it with no missing or unexpected keys and gives
the original model's outputs bit for bit. The import of a model directory follows the same
rule (``drop_unsaved``): its checkpoint is the model's ``state_dict()``, so a strict restore
into a freshly built model works, and its import record names what it left out.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel

from ckptflow import Checkpointer
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.interop.export import export_safetensors, load_exported
from ckptflow.interop.importers import import_checkpoint
from ckptflow.store import open_store
from support.cli import run_cli
from support.minilm import SENTENCE, minilm_dir
from support.tiny_bert import BERT


def old_style_bert_dir(path: str) -> BertModel:
    """A model directory as an older transformers wrote it: the state dict plus the
    ``embeddings.position_ids`` buffer, beside a config.json naming ``BertModel``."""
    torch.manual_seed(0)
    model = BertModel(BertConfig(**BERT)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    assert "embeddings.position_ids" not in model.state_dict()  # non-persistent in this transformers
    os.mkdir(path)
    model.config.architectures = ["BertModel"]
    model.config.save_pretrained(path)
    tensors = {n: t.contiguous() for n, t in model.state_dict().items()}
    tensors["embeddings.position_ids"] = model.embeddings.position_ids.clone()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return model


def import_and_export(tmp_path, capsys, src: str) -> str:
    """Import the model directory ``src`` (``ckptflow import``) and export it; checks that the
    import left out ``embeddings.position_ids`` alone, saying so and naming it in its record."""
    root, out = str(tmp_path / "store"), str(tmp_path / "exported")
    code, said, _ = run_cli(capsys, "import", root, src, "--run", "r", "--step", "1")
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        in_file = len(list(f.keys()))
    assert code == 0 and f"; {in_file - 1} tensors," in said  # all but the buffer the model does not save
    assert "left out embeddings.position_ids: buffers the model of its config.json does not save" in said
    record = read_manifest(open_store(root), "r", 1).metadata["import"]
    assert record["unsaved"] == ["embeddings.position_ids"]
    export_safetensors(root, "r", out)
    return out


def test_export_with_a_config_leaves_out_a_non_persistent_buffer_and_loads_clean_in_transformers(tmp_path):
    """A bare safetensors file has no config: its import keeps every tensor, the buffer too.
    An export given the model's config leaves it out and names it in the header."""
    src = str(tmp_path / "old")
    model = old_style_bert_dir(src)
    root, out = str(tmp_path / "store"), str(tmp_path / "exported")
    imported = import_checkpoint(root, "r", 1, os.path.join(src, "model.safetensors"))
    assert imported.tensors == len(model.state_dict()) + 1  # the buffer is in the checkpoint
    with open(os.path.join(src, "config.json")) as f:
        export_safetensors(root, "r", out, model_config=json.load(f))

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(model.state_dict())  # what save_pretrained writes
        assert json.loads(f.metadata()["ckptflow.unsaved"]) == ["embeddings.position_ids"]
    loaded, info = AutoModel.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    ids = torch.randint(0, BERT["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).last_hidden_state, model(ids).last_hidden_state)
    fresh = BertModel(BertConfig(**BERT))
    fresh.load_state_dict(load_exported(out), strict=True)  # strict-clean: no unexpected buffer


def test_real_minilm_round_trips_through_a_checkpoint_to_transformers(tmp_path, capsys):
    src = minilm_dir()
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        assert "embeddings.position_ids" in f.keys()  # the older transformers' file this is about
    out = import_and_export(tmp_path, capsys, src)

    original, info = AutoModel.from_pretrained(src, output_loading_info=True)
    exported, info_out = AutoModel.from_pretrained(out, output_loading_info=True)
    for got in (info, info_out):
        assert (got["missing_keys"], got["unexpected_keys"], got["mismatched_keys"]) == (set(), set(), set())
    tokens = AutoTokenizer.from_pretrained(src)([SENTENCE], return_tensors="pt")
    with torch.no_grad():
        want = original.eval()(**tokens).last_hidden_state
        got = exported.eval()(**tokens).last_hidden_state
    assert want.shape[1] > 10 and torch.equal(got, want)
    original_state = original.state_dict()
    exported_tensors = load_exported(out)
    assert exported_tensors.keys() == original_state.keys()
    assert all(torch.equal(exported_tensors[n], original_state[n]) for n in original_state)


def test_real_minilm_imports_as_its_state_dict_and_restores_strictly_into_a_fresh_bert_model(tmp_path):
    """The import kept ``embeddings.position_ids`` from the file, so a strict restore into a
    freshly built ``BertModel`` (whose state dict lacks it) was refused: "keys in the
    checkpoint the state lacks: 'model.embeddings.position_ids'"."""
    src = minilm_dir()
    root = str(tmp_path / "store")
    imported = import_checkpoint(root, "r", 1, src)
    fresh = BertModel(BertConfig.from_pretrained(src)).eval()
    with Checkpointer(root, "r") as ck:
        restored = ck.restore({"model": fresh})  # strict
    original = AutoModel.from_pretrained(src).eval()
    assert imported.tensors == len(original.state_dict()) == 103
    assert restored.metadata["import"]["unsaved"] == ["embeddings.position_ids"]
    want = original.state_dict()
    assert fresh.state_dict().keys() == want.keys()
    assert all(torch.equal(t, want[n]) and t.dtype == want[n].dtype for n, t in fresh.state_dict().items())
    tokens = AutoTokenizer.from_pretrained(src)([SENTENCE], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(fresh(**tokens).last_hidden_state, original(**tokens).last_hidden_state)
