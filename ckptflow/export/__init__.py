"""Deployable files from a checkpoint: safetensors files and Hugging Face model directories.

``model`` is the entry point (``export_safetensors``); ``tensors`` loads and prepares a
checkpoint's tensors; ``files`` writes them deterministically (and ``load_exported``
reads them back); ``architecture`` knows which tensors are tied or ``nn.Linear``
weights; ``card`` renders the model card; ``dcp`` writes a plain DCP directory.
"""

from ckptflow.export.architecture import model_metadata, tied_weights
from ckptflow.export.card import Lineage
from ckptflow.export.dcp import export_dcp
from ckptflow.export.files import lineage_metadata, load_exported, write_safetensors
from ckptflow.export.model import (
    DEFAULT_MAX_SHARD_BYTES,
    EXPORT_DTYPES,
    ExportOptions,
    ExportResult,
    export_safetensors,
    option_problems,
)
from ckptflow.export.tensors import DTYPES, load_tensors, newest_verified_step

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DTYPES",
    "EXPORT_DTYPES",
    "ExportOptions",
    "ExportResult",
    "Lineage",
    "export_dcp",
    "export_safetensors",
    "lineage_metadata",
    "load_exported",
    "load_tensors",
    "model_metadata",
    "newest_verified_step",
    "option_problems",
    "tied_weights",
    "write_safetensors",
]
