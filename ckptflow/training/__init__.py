"""What training code calls on every rank: ``Checkpointer`` save and restore, state trees.

Imports nothing from lifecycle, reports, interop or Dagster (import-linter contract in pyproject.toml)."""

from ckptflow.training.checkpointer import Checkpointer, SaveHandle, SaveResult
from ckptflow.training.restore import RestoreResult

__all__ = ["Checkpointer", "RestoreResult", "SaveHandle", "SaveResult"]
