"""Tied weights recorded at save time: a plain ``ck.save(step, {"model": model})`` of a real
transformers GPT-2 (built from a config on CPU, nothing downloaded, no model metadata)
records which tensors are one tensor in its sealed manifest, so the export writes the
shared tensor once, under the name transformers keeps, and the real loaders accept it:
``safetensors.torch.load_model(strict=True)`` and ``from_pretrained``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_model
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from ckptflow import Checkpointer
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.errors import ManifestError
from ckptflow.interop.export import ExportOptions, export_safetensors
from ckptflow.store import open_store
from support.corrupt import reseal_manifest

CONFIG = {"vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64, "bos_token_id": 0}
IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG, eos_token_id=0)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def saved(tmp_path) -> tuple[str, GPT2LMHeadModel]:
    root = str(tmp_path / "store")
    model = gpt2()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(IDS, labels=IDS).loss.backward()
    optim.step()
    model.eval()
    with Checkpointer(root, "run") as ck:
        ck.save(1, {"model": model, "optim": optim})  # no model metadata at all
    return root, model


def test_the_manifest_records_the_tie_groups_it_saw(tmp_path):
    root, _ = saved(tmp_path)
    manifest = read_manifest(open_store(root), "run", 1)
    assert manifest.tied == (("model.transformer.wte.weight", "model.lm_head.weight"),)
    doc = json.loads((tmp_path / "store" / "runs/run/checkpoints/000000000001/manifest.json").read_bytes())
    assert doc["tied"] == [["model.transformer.wte.weight", "model.lm_head.weight"]]  # sealed with the commit


def test_a_plain_save_of_gpt2_exports_what_load_model_strict_and_from_pretrained_accept(tmp_path):
    root, model = saved(tmp_path)
    out = tmp_path / "gpt2.safetensors"
    export_safetensors(root, "run", out)
    with safe_open(str(out), "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # transformers' convention
    assert json.loads(meta["ckptflow.tied"]) == {"lm_head.weight": "transformer.wte.weight"}
    fresh = gpt2(seed=5)
    assert load_model(fresh, str(out), strict=True) == (set(), [])
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(logits(fresh.eval()), logits(model))

    directory = tmp_path / "dir"
    export_safetensors(root, "run", directory)
    assert not (directory / "config.json").exists()  # none recorded: the user adds the model's own
    GPT2Config(**CONFIG, eos_token_id=0).save_pretrained(directory)
    loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(logits(loaded), logits(model))


def test_with_the_models_config_given_the_directory_loads_on_its_own(tmp_path):
    root, model = saved(tmp_path)
    config = {**GPT2Config(**CONFIG, eos_token_id=0).to_dict(), "architectures": ["GPT2LMHeadModel"]}
    out = tmp_path / "dir"
    result = export_safetensors(root, "run", out, options=ExportOptions(dtype="bf16"), model_config=config)
    assert "config.json" in result.files
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.dtype == torch.bfloat16 and loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(logits(loaded), logits(model.to(torch.bfloat16)))


def test_only_tensors_that_share_storage_are_recorded(tmp_path):
    """Equal values are no tie (fresh LayerNorms are all ones); one tensor under two names is."""
    shared = torch.arange(6.0)
    state = {"a": nn.LayerNorm(4), "b": nn.LayerNorm(4), "x": shared, "y": shared, "z": shared.clone()}
    with Checkpointer(str(tmp_path / "s"), "r") as ck:
        ck.save(1, state)
    assert read_manifest(open_store(str(tmp_path / "s")), "r", 1).tied == (("x", "y"),)


@pytest.mark.parametrize("tied", ["model.lm_head.weight", [["model.lm_head.weight"]], [["a", 3]], [["a", "a"]]])
def test_a_malformed_tie_record_is_a_damaged_manifest(tmp_path, tied):
    root, _ = saved(tmp_path)
    reseal_manifest(root, "run", 1, lambda doc: doc.__setitem__("tied", tied))
    with pytest.raises(ManifestError, match="tied"):
        read_manifest(open_store(root), "run", 1)
