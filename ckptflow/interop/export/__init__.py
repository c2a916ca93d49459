"""Deployable files from a checkpoint: safetensors files and Hugging Face model directories.

``model`` is the entry point (``export_safetensors``); ``tensors`` loads and prepares a
checkpoint's tensors; ``files`` writes them deterministically (and ``load_exported``
reads them back); ``architecture`` knows which tensors are tied or ``nn.Linear``
weights; ``card`` renders the model card; ``dcp`` writes a plain DCP directory.
"""

from typing import TYPE_CHECKING, Any

from ckptflow.interop.export.options import DEFAULT_MAX_SHARD_BYTES, EXPORT_DTYPES

_LAZY = {  # torch is imported when one of these is first used
    "model_metadata": "architecture", "tied_weights": "architecture", "read_config": "architecture",
    "Lineage": "card",
    "lineage_metadata": "files", "load_exported": "files", "write_safetensors": "files",
    "ExportOptions": "model", "ExportResult": "model", "export_safetensors": "model", "option_problems": "model",
    "DTYPES": "tensors", "load_tensors": "tensors", "newest_verified_step": "tensors", "export_dcp": "dcp",
}  # fmt: skip

if TYPE_CHECKING:
    from ckptflow.interop.export.architecture import model_metadata, read_config, tied_weights
    from ckptflow.interop.export.card import Lineage
    from ckptflow.interop.export.dcp import export_dcp
    from ckptflow.interop.export.files import lineage_metadata, load_exported, write_safetensors
    from ckptflow.interop.export.model import ExportOptions, ExportResult, export_safetensors, option_problems
    from ckptflow.interop.export.tensors import DTYPES, load_tensors, newest_verified_step


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"ckptflow.interop.export.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptflow.interop.export' has no attribute {name!r}")


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
    "read_config",
    "tied_weights",
    "write_safetensors",
]
