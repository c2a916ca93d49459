"""A tied-alias bomb: a small file naming one stored tensor thousands of times.

The import's bound on the bytes views may claim counted tied (aliased) names once, as
one view. But the save hashes every name's bytes and a restore or export gives every
name its own tensor: a 1 MiB file whose ``ckptflow.tied`` header names its one tensor
300 times imported as 301 MiB of tensors, and exporting the checkpoint held them all in
memory at once. Every name counts now; a real model's tied embeddings (two names of one
tensor) still import, as does all-MiniLM-L6-v2.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckptflow import Checkpointer
from ckptflow.errors import CkptflowError
from ckptflow.interop.export.files import TIED_KEY
from ckptflow.interop.importers import import_checkpoint
from support.minilm import minilm_dir

MIB_OF_FLOATS = 1 << 18
ALIASES = 300  # 301 MiB claimed from 1 MiB stored: past 4 x 1 MiB + 64 MiB


def refused(tmp_path, path) -> str:
    with pytest.raises(CkptflowError) as caught:
        import_checkpoint(str(tmp_path / "store"), "r", 1, path)
    assert not (tmp_path / "store" / "runs").exists()  # nothing committed
    return str(caught.value)


def test_a_safetensors_file_tying_one_tensor_to_many_names_is_refused(tmp_path):
    path = tmp_path / "bomb.safetensors"
    tied = {f"alias.{i}": "w" for i in range(ALIASES)}
    save_file({"w": torch.randn(MIB_OF_FLOATS)}, path, metadata={TIED_KEY: json.dumps(tied)})
    assert os.path.getsize(path) < (1 << 20) + (16 << 10)  # a 1 MiB tensor and a 10 KB header
    err = refused(tmp_path, path)
    assert f"its {ALIASES + 1} tensors claim {(ALIASES + 1) << 20} bytes together, but the file stores 1048576" in err
    assert "one tensor tied to many names" in err and "t.clone()" in err


def test_a_torch_file_sharing_one_tensor_among_many_names_is_refused(tmp_path):
    shared = torch.randn(MIB_OF_FLOATS)
    torch.save({f"w{i}": shared for i in range(ALIASES + 1)}, tmp_path / "bomb.pt")  # one storage in the file
    err = refused(tmp_path, tmp_path / "bomb.pt")
    assert f"its {ALIASES + 1} tensors claim {(ALIASES + 1) << 20} bytes together" in err


def test_tied_embeddings_of_the_real_minilm_import_and_restore(tmp_path):
    """MiniLM's tensors with an MLM decoder tied to its 30522 x 384 word embeddings (as a
    ckptflow export of BertForMaskedLM writes it: once, plus the header): both names
    import, and restore equal to each other."""
    with safe_open(os.path.join(minilm_dir(), "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    path = tmp_path / "tied.safetensors"
    save_file(tensors, path, metadata={TIED_KEY: json.dumps({"decoder.weight": "embeddings.word_embeddings.weight"})})
    result = import_checkpoint(str(tmp_path / "store"), "r", 1, path)
    assert result.tensors == len(tensors) + 1
    live = {
        "model": {
            n: torch.zeros_like(t)
            for n, t in {**tensors, "decoder.weight": tensors["embeddings.word_embeddings.weight"]}.items()
        }
    }
    with Checkpointer(str(tmp_path / "store"), "r") as ck:
        ck.restore(live)
    assert torch.equal(live["model"]["decoder.weight"], tensors["embeddings.word_embeddings.weight"])
    assert all(torch.equal(live["model"][n], t) for n, t in tensors.items())


def test_the_real_minilm_directory_imports(tmp_path):
    result = import_checkpoint(str(tmp_path / "store"), "r", 1, minilm_dir())
    assert result.tensors == 103 and result.bytes == 90852864  # less embeddings.position_ids (512 int64)
