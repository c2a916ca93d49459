"""Helpers shared by test_cli.py (ls / verify / stats / console script) and
test_cli_export_gc.py (export / gc / argument errors): tiny training states, ``run_cli``,
chunk lookups and corruption, and ``make_store`` (run ``alpha``, steps 10 and 20).

Each of those modules wraps ``make_store`` in its own ``store`` fixture: a ``store``
fixture in conftest.py would collide with test_store.py's unrelated ``store`` fixture.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ckptflow import Checkpointer
from ckptflow import format as fmt
from ckptflow.catalog import read_manifest
from ckptflow.cli import main
from ckptflow.state import flatten, to_state_dicts
from ckptflow.store import open_store

RUN = "alpha"


def make_state(seed: int = 0, *, optimizer: bool = True) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    state: dict = {"model": model}
    if optimizer:
        state["optim"] = torch.optim.Adam(model.parameters(), lr=1e-2)
    return state


def train(state: dict, steps: int = 2) -> None:
    model, optim = state["model"], state["optim"]
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


def tensor_bytes(state: dict) -> int:
    """What a manifest's logical_bytes must be for ``state``: every tensor's bytes."""
    _, tensors = flatten(to_state_dicts(state))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def chunks_of(root: str, run: str, step: int) -> dict[str, int]:
    return read_manifest(open_store(root), run, step)[0]["chunks"]


def chunk_path(root: str, digest: str) -> Path:
    return Path(root) / fmt.chunk_key(digest)


def tensor_chunk(root: str, run: str, step: int, fqn: str) -> str:
    manifest, _ = read_manifest(open_store(root), run, step)
    (item,) = [i for i in manifest["dcp"]["items"] if i["fqn"] == fqn]
    return item["chunks"][0][0]


def flip_last_byte(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    path.write_bytes(bytes(blob))



def make_store(tmp_path):
    """Run ``alpha`` with steps 10 and 20 (training in between); model snapshots and sizes."""
    root = str(tmp_path / "store")
    state = make_state()
    snaps, sizes = {}, {}
    with Checkpointer(root, RUN) as ckpt:
        for step, loss in ((10, 0.5), (20, 0.25)):
            train(state)
            ckpt.save(step, state, metadata={"loss": loss})
            snaps[step] = {k: v.detach().clone() for k, v in state["model"].state_dict().items()}
            sizes[step] = tensor_bytes(state)
    return root, snaps, sizes
