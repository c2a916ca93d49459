"""The evaluator: a pluggable function that scores a checkpoint's model weights.

Named by import path (``package.module:function``) rather than imported here, so the
resource layer does not depend on any model code, and a team swaps evaluators (a new
validation set, a new metric) by changing one string in run config and backfilling
the evaluation partitions.
"""

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from dagster import ConfigurableResource
from pydantic import Field

from ckptflow.export import load_tensors

Evaluate = Callable[[Mapping[str, Any], Mapping[str, Any]], Mapping[str, float]]
DEFAULT_EVALUATOR = "pipelines.tinylm_eval:evaluate"


def load_function(path: str) -> Evaluate:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"evaluator {path!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module), name)


class EvaluatorResource(ConfigurableResource):
    """``evaluate(state_dict, info) -> {metric: float}``; the default scores the demo
    TinyLM's validation loss on generated held-out data."""

    function: str = Field(default=DEFAULT_EVALUATOR, description="import path 'module:function'")
    key: str = Field(default="model", description="top-level state key holding the model's tensors")

    def evaluate(self, store: Any, run: str, step: int, info: Mapping[str, Any]) -> dict[str, float]:
        """Load the model tensors (every chunk verified) and score them."""
        tensors, manifest, _ = load_tensors(store, run, step, prefix=self.key.rstrip(".") + ".")
        metrics = load_function(self.function)(tensors, {**info, "metadata": manifest.get("metadata") or {}})
        return {str(k): float(v) for k, v in metrics.items()}
