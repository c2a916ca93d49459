"""Buffers a model does not save (``persistent=False``), carried by an imported file.

Older transformers wrote BERT's ``embeddings.position_ids`` into ``model.safetensors``
(all-MiniLM-L6-v2's file still holds it); today's ``BertModel`` registers it as a
non-persistent buffer, so it is not in the model's ``state_dict()``. Such a file imports
as it is, and exporting it used to be refused ("not in the config's model:
embeddings.position_ids"): a real model could not go import -> checkpoint -> model
directory at all. The export now writes what the model saves, as ``save_pretrained``
does, and names what it left out in the header; the real ``from_pretrained`` loads it
with no missing or unexpected keys and gives the original model's outputs bit for bit.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel

from ckptflow.interop.export import export_safetensors, load_exported
from ckptflow.interop.importers import import_checkpoint
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


def import_and_export(tmp_path, src: str) -> str:
    root, out = str(tmp_path / "store"), str(tmp_path / "exported")
    imported = import_checkpoint(root, "r", 1, src)
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        assert imported.tensors == len(list(f.keys()))  # the import keeps every tensor of the file
    export_safetensors(root, "r", out)
    return out


def test_export_of_an_imported_file_with_a_non_persistent_buffer_loads_clean_in_transformers(tmp_path):
    src = str(tmp_path / "old")
    model = old_style_bert_dir(src)
    out = import_and_export(tmp_path, src)

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


def test_real_minilm_round_trips_through_a_checkpoint_to_transformers(tmp_path):
    src = minilm_dir()
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        assert "embeddings.position_ids" in f.keys()  # the older transformers' file this is about
    out = import_and_export(tmp_path, src)

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
