"""An int8 export always says it is quantized where transformers looks: config.json.

A checkpoint saved without its model config (a plain ``ck.save(step, {"model": model})``)
has no config.json to declare the quantization in; with the model's ordinary
config.json added by hand, ``from_pretrained`` would load the int8 codes as float
weights without a word. So such an export is refused, saying what to pass, and with the
config passed (``--config``, ``model_config=``) the directory's config.json declares the
quantization and the real ``from_pretrained`` computes what the dequantized weights give.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, BertConfig, BertModel

from ckptflow import Checkpointer
from ckptflow.errors import CkptflowError
from ckptflow.interop.export import ExportOptions, export_safetensors, load_exported
from support.child_env import child_env
from support.cli import run_cli
from support.tiny_bert import BERT

IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
INT8 = ExportOptions(dtype="int8")


def bert(seed: int = 0, **config) -> BertModel:
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**{**BERT, **config})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def hidden(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).last_hidden_state


def saved_without_config(tmp_path) -> tuple[str, BertModel]:
    root = str(tmp_path / "store")
    model = bert()
    with Checkpointer(root, "run") as ck:
        ck.save(1, {"model": model})
    return root, model


def config_file(tmp_path, model: BertModel) -> str:
    """The model's ordinary config.json, as ``model.save_pretrained`` writes it."""
    model.save_pretrained(tmp_path / "pretrained")
    return str(tmp_path / "pretrained" / "config.json")


def nothing_written(tmp_path, name: str) -> bool:
    return not [p for p in os.listdir(tmp_path) if p.startswith(name)]


def test_int8_without_a_model_config_is_refused_saying_what_to_pass(tmp_path):
    root, _ = saved_without_config(tmp_path)
    with pytest.raises(CkptflowError) as refused:
        export_safetensors(root, "run", tmp_path / "int8", options=INT8)
    message = str(refused.value)
    assert "config.json" in message and "--config" in message and "model_config=" in message
    assert "model_metadata(model)" in message
    assert nothing_written(tmp_path, "int8")


def test_int8_with_the_config_given_declares_its_quantization_and_loads_right(tmp_path):
    root, model = saved_without_config(tmp_path)
    with open(config_file(tmp_path, model), encoding="utf-8") as f:
        config = json.load(f)
    out = tmp_path / "int8"
    result = export_safetensors(root, "run", out, options=INT8, model_config=config)
    assert set(result.files) == {"model.safetensors", "config.json", "README.md"}
    written = json.loads((out / "config.json").read_text())
    assert written["quantization_config"]["quant_method"] == "compressed-tensors"
    assert written["architectures"] == ["BertModel"] and written["hidden_size"] == 32
    reference = bert(seed=5)
    reference.load_state_dict(load_exported(out), strict=True)  # the dequantized weights
    loaded = AutoModel.from_pretrained(out).eval()
    got = hidden(loaded)
    assert torch.allclose(got, hidden(reference), atol=1e-5)
    exact = hidden(model)
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()


def test_int8_to_a_single_file_is_refused_it_has_no_config_json(tmp_path):
    root, model = saved_without_config(tmp_path)
    with open(config_file(tmp_path, model), encoding="utf-8") as f:
        config = json.load(f)
    with pytest.raises(CkptflowError, match="model directory"):
        export_safetensors(root, "run", tmp_path / "q.safetensors", options=INT8, model_config=config)
    assert nothing_written(tmp_path, "q.safetensors")


def test_a_config_of_another_model_is_refused(tmp_path):
    root, _ = saved_without_config(tmp_path)
    other = bert(hidden_size=64, intermediate_size=128)
    with open(config_file(tmp_path, other), encoding="utf-8") as f:
        config = json.load(f)
    with pytest.raises(CkptflowError, match=r"does not describe.*shape") as refused:
        export_safetensors(root, "run", tmp_path / "int8", options=INT8, model_config=config)
    assert "embeddings.LayerNorm.weight [32] / [64]" in str(refused.value)  # as saved / as the config says
    assert nothing_written(tmp_path, "int8")


def test_cli_int8_needs_config_and_writes_it(tmp_path, capsys):
    root, model = saved_without_config(tmp_path)
    code, _, err = run_cli(capsys, "export", root, "--run", "run", "--out", tmp_path / "int8", "--dtype", "int8")
    assert code == 2 and "--config" in err and nothing_written(tmp_path, "int8")
    path = config_file(tmp_path, model)
    code, stdout, err = run_cli(
        capsys, "export", root, "--run", "run", "--out", tmp_path / "int8", "--dtype", "int8", "--config", path
    )
    assert code == 0, err
    assert "config.json" in stdout
    assert json.loads((tmp_path / "int8" / "config.json").read_text())["quantization_config"]["format"] == (
        "naive-quantized"
    )
    assert AutoModel.from_pretrained(tmp_path / "int8") is not None
    (tmp_path / "bad.json").write_text("[1, 2]")
    bad = ("--dtype", "int8", "--config", tmp_path / "bad.json")
    code, _, err = run_cli(capsys, "export", root, "--run", "run", "--out", tmp_path / "x", *bad)
    assert code == 2 and "bad.json" in err and "JSON object" in err


def test_a_fifo_given_as_the_config_is_refused_instead_of_blocking_the_export(tmp_path):
    """The same check as every file an import opens (``interop.source_files``), in a process
    of its own that the timeout ends if it blocks."""
    root, _ = saved_without_config(tmp_path)
    os.mkfifo(tmp_path / "config.json")
    command = ["export", root, "--run", "run", "--out", tmp_path / "int8", "--dtype", "int8"]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ckptflow", *map(str, command), "--config", str(tmp_path / "config.json")],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(Path(__file__).resolve().parents[3]),
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the export blocked opening the FIFO given as --config")
    assert done.returncode == 2 and "config.json is not a regular file" in done.stderr, done.stderr
    assert nothing_written(tmp_path, "int8")


def test_importing_an_int8_model_directory_is_refused_its_weights_are_codes(tmp_path, capsys):
    """The importer read only ``architectures`` of config.json and ignored its
    ``quantization_config``: the int8 codes and their ``weight_scale`` were committed as the
    model's weights, an ordinary (not lossy) checkpoint that restored into no model."""
    root, model = saved_without_config(tmp_path)
    with open(config_file(tmp_path, model), encoding="utf-8") as f:
        export_safetensors(root, "run", tmp_path / "int8", options=INT8, model_config=json.load(f))
    code, _, err = run_cli(capsys, "import", tmp_path / "imported", tmp_path / "int8", "--run", "r", "--step", "1")
    assert code == 2 and not (tmp_path / "imported" / "runs").exists()
    assert f"{tmp_path / 'int8' / 'config.json'} declares quantization_config (compressed-tensors)" in err
    assert "its weights are quantized codes, not the values trained" in err and "load_exported" in err
