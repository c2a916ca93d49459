"""Which evaluator scores which run.

Evaluators are named by import path (``package.module:function``), chosen per run by a
pattern on the run name, so one code location serves a store that holds many teams'
models: a run no pattern matches is evaluated from the metrics its trainer recorded
(``ckptflow.lifecycle.evaluate``), and a new validation set is one string in run config
plus a backfill of ``evaluation``.
"""

import fnmatch
import importlib
import json
import os

from dagster import ConfigurableResource
from pydantic import Field

from ckptflow.lifecycle import Evaluator

EVALUATORS_ENV = "CKPTFLOW_EVALUATORS"


def load_function(path: str) -> Evaluator:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"evaluator {path!r} must look like 'package.module:function'")
    function = getattr(importlib.import_module(module), name, None)
    if not callable(function):
        raise ValueError(f"evaluator {path!r}: {module} has no function {name!r}")
    return function


def evaluators_from_env(default: dict[str, str]) -> dict[str, str]:
    """``CKPTFLOW_EVALUATORS`` as JSON (``{"gpt-*": "team.eval:score"}``), else ``default``."""
    text = os.environ.get(EVALUATORS_ENV, "").strip()
    if not text:
        return dict(default)
    try:
        mapping = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{EVALUATORS_ENV} must be a JSON object of run pattern -> 'module:function': {e}") from None
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise ValueError(f"{EVALUATORS_ENV} must be a JSON object of run pattern -> 'module:function'")
    return mapping


class EvaluatorResource(ConfigurableResource):
    """``evaluators``: run-name glob pattern -> ``module:function`` (first match wins), each
    ``evaluate(state_dict, info) -> {metric: float}``. Unmatched runs: trainer metrics."""

    evaluators: dict[str, str] = Field(default_factory=dict, description="run-name pattern -> 'module:function'")
    key: str = Field(default="model", description="top-level state key holding the model's tensors")
    val_metric: str = Field(default="val_loss", description="the metric that says 'better'")
    train_metric: str = Field(default="train_loss", description="the training metric of the overfitting rule")
    mode: str = Field(default="min", description="'min' if lower val_metric is better, else 'max'")

    def name_for(self, run: str) -> str | None:
        return next((path for pattern, path in self.evaluators.items() if fnmatch.fnmatchcase(run, pattern)), None)
