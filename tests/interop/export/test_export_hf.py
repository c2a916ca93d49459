"""Model directories checked with the real clients: transformers' ``from_pretrained`` (CPU,
tiny GPT-2, BERT and BERT-MLM models built from configs, nothing downloaded) and
``safetensors.torch.load_model(strict=True)``, plus ckptflow's own ``load_exported``.

fp32 and bf16 exports give bit-equal outputs and keep tied weights tied; a sharded export
loads the same; int8 (compressed-tensors layout) loads within the quantization error and
equal to ckptflow's dequantization, strict loaders refuse it, and GPT-2 (Conv1D
projections, which the format cannot hold) is refused at export.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_model
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    BertForMaskedLM,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
)

from ckptflow import Checkpointer
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.errors import CkptflowError
from ckptflow.interop.export import ExportOptions, export_safetensors, load_exported, model_metadata
from ckptflow.interop.export.quantize import SCALE
from ckptflow.store import open_store

VOCAB = 96
BERT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
MODELS = {
    "gpt2": (
        GPT2LMHeadModel,
        lambda: GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0
        ),
        AutoModelForCausalLM,
    ),
    "bert": (BertModel, lambda: BertConfig(**BERT), AutoModel),
    "bert-mlm": (BertForMaskedLM, lambda: BertConfig(**BERT), AutoModelForMaskedLM),
}
TIED = {"gpt2", "bert-mlm"}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """A freshly built model, perturbed so no two tensors are equal by accident (as after training)."""
    cls, config, _ = MODELS[name]
    torch.manual_seed(seed)
    model = cls(config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def outputs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def saved(tmp_path, name: str) -> tuple[str, torch.nn.Module]:
    root = str(tmp_path / "store")
    model = build(name)
    with Checkpointer(root, "run") as ck:
        ck.save(7, {"model": model}, metadata={**model_metadata(model), "config": {"lr": 3e-4}, "data": "synthetic"})
    return root, model


IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dtype", ["", "bf16"])
def test_from_pretrained_is_bit_exact_and_keeps_ties(tmp_path, name, dtype):
    root, model = saved(tmp_path, name)
    out = tmp_path / "model"
    result = export_safetensors(root, "run", out, options=ExportOptions(dtype=dtype))
    assert set(result.files) == {"model.safetensors", "config.json", "README.md"}
    loaded = MODELS[name][2].from_pretrained(out).eval()
    expected = model.to(torch.bfloat16) if dtype == "bf16" else model
    assert loaded.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
    assert torch.equal(outputs(loaded, IDS), outputs(expected, IDS))
    for (n, a), b in zip(sorted(loaded.state_dict().items()), [v for _, v in sorted(expected.state_dict().items())]):
        assert torch.equal(a, b), n
    if name in TIED:
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    # the shared tensor is written once, under the name transformers and load_model keep
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert meta["ckptflow.manifest_digest"] == read_manifest(open_store(root), "run", 7).digest
    if name == "gpt2":
        assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
        assert json.loads(meta["ckptflow.tied"]) == {"lm_head.weight": "transformer.wte.weight"}
    fresh = build(name, seed=5).to(expected.dtype)
    assert load_model(fresh, str(out / "model.safetensors"), strict=True) == (set(), [])
    assert torch.equal(outputs(fresh, IDS), outputs(expected, IDS))
    if name in TIED:
        assert fresh.get_output_embeddings().weight is fresh.get_input_embeddings().weight


def test_sharded_directory_loads_the_same(tmp_path):
    root, model = saved(tmp_path, "gpt2")
    out = tmp_path / "sharded"
    result = export_safetensors(root, "run", out, options=ExportOptions(max_shard_bytes=40_000))
    shards = sorted(f for f in result.files if f.startswith("model-"))
    assert len(shards) > 2 and "model.safetensors.index.json" in result.files
    assert "model.safetensors" not in result.files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == result.bytes
    for shard in shards:  # each under the limit, unless one tensor alone is bigger
        with safe_open(str(out / shard), "pt") as f:
            sizes = [f.get_tensor(k).numel() * 4 for k in f.keys()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(outputs(loaded, IDS), outputs(model, IDS))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    fresh = build("gpt2", seed=5)
    fresh.load_state_dict(load_exported(out), strict=True)
    assert torch.equal(outputs(fresh, IDS), outputs(model, IDS))


@pytest.mark.parametrize("name", ["bert", "bert-mlm"])
def test_int8_loads_in_transformers_within_the_quantization_error(tmp_path, name):
    root, model = saved(tmp_path, name)
    out = tmp_path / "int8"
    export_safetensors(root, "run", out, options=ExportOptions(dtype="int8"))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        q = {k: f.get_tensor(k) for k in f.keys()}
    query = "encoder.layer.0.attention.self.query." if name == "bert" else "bert.encoder.layer.0.attention.self.query."
    assert q[query + "weight"].dtype == torch.int8 and q[query + SCALE].shape == (32, 1)
    # ckptflow's loader: dequantized weights within half a step of the originals
    dequantized = load_exported(out)
    original = model.state_dict()
    for weight in [k for k in q if k.endswith("." + SCALE)]:
        w = weight[: -len(SCALE)] + "weight"
        step = q[weight]
        assert ((dequantized[w] - original[w]).abs() <= step / 2 + 1e-7).all(), w
    reference = build(name, seed=5)
    reference.load_state_dict(dequantized, strict=True)
    # transformers (compressed-tensors, on CPU) computes exactly what the dequantized weights give
    loaded = MODELS[name][2].from_pretrained(out).eval()
    got = outputs(loaded, IDS)
    assert torch.allclose(got, outputs(reference, IDS), atol=1e-5)
    exact = outputs(model, IDS)
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()  # not garbage: a few % at most
    if name == "bert-mlm":  # the tied decoder stays unquantized and tied
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
        assert "cls.predictions.decoder" in config["quantization_config"]["ignore"]
    # a strict loader that does not know the format refuses it instead of loading codes as floats
    with pytest.raises(RuntimeError, match="Unexpected key"):
        load_model(build(name, seed=5), str(out / "model.safetensors"), strict=True)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        build(name, seed=5).load_state_dict(q, strict=True)


def test_int8_of_gpt2_is_refused_at_export(tmp_path):
    """GPT-2's projections are Conv1D, which compressed-tensors cannot hold, and its only
    nn.Linear (lm_head) is tied: no format transformers loads would be correct."""
    root, _ = saved(tmp_path, "gpt2")
    out = tmp_path / "int8"
    with pytest.raises(CkptflowError, match="no weight to quantize.*Conv1D.*export bf16"):
        export_safetensors(root, "run", out, options=ExportOptions(dtype="int8"))
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith("int8")]


def test_model_card_carries_the_lineage(tmp_path):
    root, _ = saved(tmp_path, "bert-mlm")
    out = tmp_path / "model"
    export_safetensors(root, "run", out)
    card = (out / "README.md").read_text()
    digest = read_manifest(open_store(root), "run", 7).digest
    for expected in ("run@7", digest, "BertForMaskedLM", '"lr": 0.0003', "synthetic", "library_name"):
        assert expected in card, expected


def test_transformers_without_compressed_tensors_refuses_int8(tmp_path, monkeypatch):
    """Where the compressed-tensors package is missing, transformers raises instead of
    loading int8 codes into float parameters (its availability check is patched to say so)."""
    import transformers.quantizers.quantizer_compressed_tensors as quantizer
    import transformers.utils.quantization_config as quantization

    root, _ = saved(tmp_path, "bert")
    export_safetensors(root, "run", tmp_path / "int8", options=ExportOptions(dtype="int8"))
    monkeypatch.setattr(quantizer, "is_compressed_tensors_available", lambda *a, **k: False)
    monkeypatch.setattr(quantization, "is_compressed_tensors_available", lambda *a, **k: False)
    with pytest.raises(ImportError, match="compressed-tensors"):
        AutoModel.from_pretrained(tmp_path / "int8")


def test_another_entry_than_the_recorded_config_describes_is_refused(tmp_path):
    """The run recorded the config of 'model'; ``--key draft`` (a one-layer draft model saved
    beside it) was written under that config.json unchecked, and transformers loaded it with
    the second layer initialised at random. The recorded config is now checked as a given one is."""
    model = build("gpt2")
    cls, config, _ = MODELS["gpt2"]
    draft = cls(GPT2Config(**{**config().to_dict(), "n_layer": 1})).eval()
    root = str(tmp_path / "store")
    with Checkpointer(root, "run") as ck:
        ck.save(7, {"model": model, "draft": draft}, metadata=model_metadata(model))
    with pytest.raises(CkptflowError, match=r"config the run recorded \(GPT2LMHeadModel.*under 'draft'.*h\.1\."):
        export_safetensors(root, "run", tmp_path / "out", options=ExportOptions(key="draft"))
    assert not (tmp_path / "out").exists()
    export_safetensors(root, "run", tmp_path / "model")  # the entry it describes


def test_every_file_of_a_model_directory_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """The shards were fsynced, but config.json, README.md and the index were not, nor the
    directories: a crash after the rename could leave a model directory whose config.json is
    empty beside its weights, or no directory at all."""
    root, _model = saved(tmp_path, "gpt2")
    out = tmp_path / "sharded"
    events: list[tuple[str, str]] = []
    fsync, rename = os.fsync, os.rename

    def recorded_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def recorded_rename(src, dst):
        events.append(("rename", os.fspath(dst)))
        return rename(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "rename", recorded_rename)
    result = export_safetensors(root, "run", out, options=ExportOptions(max_shard_bytes=40_000))
    renamed = events.index(("rename", str(out)))
    synced = {os.path.basename(path).split(".tmp-")[0] for op, path in events[:renamed] if op == "fsync"}
    assert set(result.files) | {"config.json", "README.md", "model.safetensors.index.json"} <= synced
    assert any(op == "fsync" and os.path.basename(path).startswith("sharded.tmp-") for op, path in events[:renamed])
    assert ("fsync", str(tmp_path)) in events[renamed:]  # the rename itself
