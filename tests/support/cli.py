"""The CLI tests' store (run ``alpha``, steps 10 and 20) and ``run_cli``."""

from __future__ import annotations

from ckptflow import Checkpointer
from ckptflow.cli import main
from support.states import tensor_bytes, tiny_state, tiny_train

RUN = "alpha"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def make_store(tmp_path):
    """Run ``alpha`` with steps 10 and 20 (training in between); model snapshots and sizes."""
    root = str(tmp_path / "store")
    state = tiny_state()
    snaps, sizes = {}, {}
    with Checkpointer(root, RUN, pack_bytes=1024) as ckpt:  # weights their own chunks; biases, steps packed
        for step, loss in ((10, 0.5), (20, 0.25)):
            tiny_train(state, 2)
            ckpt.save(step, state, metadata={"loss": loss})
            snaps[step] = {k: v.detach().clone() for k, v in state["model"].state_dict().items()}
            sizes[step] = tensor_bytes(state)
    return root, snaps, sizes
