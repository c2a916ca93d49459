"""The demo's recovery choices: corrupt the newest checkpoint, recover to the newest
*validated* one, then resume twice from it with a fresh optimizer (its moments were not
restored), once without and once with a warm-up, and show both loss curves."""

from __future__ import annotations

import torch

from ckptflow import Checkpointer, Warmup, lifecycle
from ckptflow.store import open_store
from ckptflow.training.warmup import warm_up
from pipelines.demo.damage import corrupt_newest
from pipelines.demo.model import build, train_step
from pipelines.demo.text import wrapped

RUN = "tinylm-recover"


def _curve(losses: list[float], low: float, high: float, width: int = 30) -> list[str]:
    span = (high - low) or 1.0
    return ["#" * max(1, round(width * (v - low) / span)) for v in losses]


def resume_curve(root: str, step: int, *, warmup: Warmup | None, steps: int) -> list[float]:
    """Losses of ``steps`` steps from ``step``'s weights and data position, with a fresh
    optimizer (a model-only restore), with or without ``warmup``."""
    torch.manual_seed(1)
    state = build()
    with Checkpointer(root, RUN) as ck:
        result = ck.restore({"model": state["model"], "data": state["data"]}, step=step)
    if warmup is not None:
        report = warm_up(result, state, warmup)
        state["sched"] = report.lr  # train_step steps it in place of the cosine schedule it wraps
    return [train_step(state) for _ in range(steps)]


def recover_demo(root: str, *, steps: int = 40, every: int = 10, after: int = 20) -> dict:
    """Train ``steps`` steps into ``root`` saving every ``every``, validate, corrupt the
    newest, recover to ``validated`` and compare resumes; returns what it printed about."""
    print(f"== recovering to a validated checkpoint (run {RUN!r} in {root})")
    torch.manual_seed(0)
    state = build()
    with Checkpointer(root, RUN) as ck:
        for step in range(1, steps + 1):
            loss = train_step(state)
            if step % every == 0:
                ck.save(step, state, metadata={"train_loss": round(loss, 4)})
    store = open_store(root)
    newest = corrupt_newest(root, RUN)
    verdicts = {
        s: lifecycle.validate(store, RUN, s)["ok"] for s in range(every, steps + 1, every) if s != steps - every
    }
    print(f"  corrupted step {newest}; validation verdicts {verdicts} (step {steps - every} not validated yet)")
    with Checkpointer(root, RUN) as ck:
        result = ck.restore(build(), select="validated")
    print(f"  restore(select='validated') -> step {result.step}; passed over:")
    for step, why in result.passed_over:
        print(wrapped(f"step {step}: {why}", indent="    "))
    plain = resume_curve(root, result.step, warmup=None, steps=after)
    warmed = resume_curve(
        root, result.step, warmup=Warmup(steps=after // 2, start_factor=0.1, scheduler="sched"), steps=after
    )
    low, high = min(plain + warmed), max(plain + warmed)
    print(
        f"  resumed from step {result.step} with a fresh optimizer: loss without | with a warm-up ({after // 2} steps)"
    )
    for i, (a, b, ba, bb) in enumerate(zip(plain, warmed, _curve(plain, low, high), _curve(warmed, low, high))):
        print(f"  {result.step + i + 1:4d}  {a:6.3f} {ba:<30} | {b:6.3f} {bb}")
    return {"validated": result.step, "passed_over": result.passed_over, "plain": plain, "warmed": warmed}
