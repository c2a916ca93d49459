"""Another team's training job: a small MLP regressor, not the demo's TinyLM, that reports
its own train and validation loss with every checkpoint.

The lifecycle knows nothing about this model: no evaluator is configured for its run,
so ``evaluation`` records the metrics the trainer saved (``metadata={"val_loss": ...}``).
Run it against a store a code location watches (``make ui``, or the daemon) and watch
its checkpoints land, validate, evaluate, compress and archive::

    python -m pipelines.demo.regressor --store .demo/store --checkpoints 3 --corrupt-newest

Each checkpoint prints its commit time, so the lifecycle's latency can be read off the
UI's run list (or ``tests/dagster/test_daemon.py`` measures it).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from ckptflow import Checkpointer
from pipelines.demo.damage import corrupt_newest

FEATURES, HIDDEN = 16, 64


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU())
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.net(x)).squeeze(-1)


def batch(seed: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth nonlinear target with noise: learnable, never memorized exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, FEATURES, generator=g)
    y = torch.sin(x[:, :4].sum(-1)) + 0.1 * x[:, 4:8].pow(2).sum(-1) + 0.05 * torch.randn(size, generator=g)
    return x, y


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store URL the lifecycle watches")
    parser.add_argument("--run", default="regressor-demo")
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument("--every", type=int, default=20, help="training steps between checkpoints")
    parser.add_argument("--start", type=int, default=0, help="first step (continue a run under the same name)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights (runs with equal seeds share chunks)")
    parser.add_argument("--corrupt-newest", action="store_true", help="damage the newest checkpoint after its commit")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    model = Regressor()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    val_x, val_y = batch(10_000_000, size=512)
    loss_fn = nn.MSELoss()
    with Checkpointer(args.store, args.run) as ck:
        for step in range(args.start + 1, args.start + args.checkpoints * args.every + 1):
            x, y = batch(step)
            loss = loss_fn(model(x), y)
            loss.backward()
            optim.step()
            optim.zero_grad()
            if step % args.every == 0:
                with torch.no_grad():
                    val_loss = loss_fn(model(val_x), val_y).item()
                metrics = {"train_loss": round(loss.item(), 5), "val_loss": round(val_loss, 5)}
                ck.save(step, {"model": model, "optim": optim}, metadata=metrics)
                print(f"committed {args.run} step {step} at {time.time():.3f} {metrics}", flush=True)
    if args.corrupt_newest:
        step = corrupt_newest(args.store, args.run)
        print(f"corrupted {args.run} step {step} on purpose", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
