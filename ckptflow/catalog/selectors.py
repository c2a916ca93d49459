"""The selectors a restore takes (``select=``, the CLI's ``--select``): what each is, how
it is parsed from text, checked and named. ``ckptflow.catalog.selection`` decides what each
accepts."""

from __future__ import annotations

from dataclasses import dataclass

from ckptflow.catalog import aliases as alias_records
from ckptflow.format import layout as fmt
from ckptflow.store import open_store
from ckptflow.store.base import Store

NAMED = ("latest", "validated")
ALIAS_CHAIN = {"latest": ("latest", "stable", "fallback"), "stable": ("stable", "fallback"), "fallback": ("fallback",)}


@dataclass(frozen=True)
class Best:
    """The best checkpoint by its score of ``metric`` (``mode`` "min": lower is better): its
    evaluation's, else what its trainer reported (``ckptflow.policy.scores``)."""

    metric: str = "val_loss"
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"Best(mode=...) must be 'min' or 'max', got {self.mode!r}")
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"Best(metric=...) must name a metric, got {self.metric!r}")


@dataclass(frozen=True)
class Alias:
    """The commit a registry alias of ``model`` was published from. ``registry``: the
    store holding the registry (a URL), the checkpoints' hot store when None."""

    model: str
    alias: str = "stable"
    registry: str | None = None

    def __post_init__(self) -> None:
        fmt.validate_run(self.model)
        if self.alias not in alias_records.ALIASES:
            raise ValueError(f"Alias(alias=...) must be one of {alias_records.ALIASES}, got {self.alias!r}")


Selector = str | int | Best | Alias


def parse(text: str) -> Selector:
    """A selector from text (the CLI's ``--select``): ``latest``, ``validated``,
    ``best:<metric>[:min|max]``, ``<model>@<alias>`` or a step number."""
    text = text.strip()
    if text in NAMED:
        return text
    if text.isdigit():
        return int(text)
    if text.startswith("best:"):
        metric, _, mode = text[5:].partition(":")
        return Best(metric, mode or "min")
    if "@" in text:
        model, _, alias = text.partition("@")
        if alias.isdigit():  # a checkpoint's name, as its Dagster partition is named
            raise ValueError(
                f"selector {text!r} names a checkpoint (<run>@<step>), not a model alias: restore run "
                f"{model!r} at step {alias} (CLI: --run {model} --step {alias}; Python: step={alias})"
            )
        return Alias(model, alias)
    raise ValueError(
        f"selector {text!r} is not one of: latest, validated, best:<metric>[:min|max], <model>@<alias>, a step number"
    )


def check(select: Selector) -> Selector:
    """``select`` if it is a selector; ``ValueError`` saying what is accepted if not."""
    if isinstance(select, (Best, Alias)) or select in NAMED:
        return select
    if isinstance(select, int) and not isinstance(select, bool):
        fmt.validate_step(select)
        return select
    if isinstance(select, str):
        return parse(select)
    raise ValueError(f"select={select!r} is not 'latest', 'validated', Best(...), Alias(...) or a step number")


def from_arguments(step: int | None, select: Selector) -> Selector:
    """One selector from a restore's ``step=`` / ``select=``, checked before anything is read."""
    if step is not None:
        if select != "latest":
            raise ValueError(f"give step={step} or select={select!r}, not both (select={step} is the same as step=)")
        return fmt.validate_step(step)
    return check(select)


def registry_store(select: Selector) -> Store | None:
    """The store an ``Alias`` names for its registry (None: the hot store)."""
    if isinstance(select, Alias) and select.registry is not None:
        return open_store(select.registry)
    return None


def describe(select: Selector) -> str:
    """How a selector is named in results, recovery records and metrics."""
    if isinstance(select, Best):
        return f"best:{select.metric}:{select.mode}"
    if isinstance(select, Alias):
        return f"{select.model}@{select.alias}"
    if isinstance(select, int):
        return f"step:{select}"
    return select
