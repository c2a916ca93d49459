"""The library installs and works without Dagster; extras bring what they declare.

A real ``pip install`` into a fresh virtual environment, from a copy of the tracked
files, then a save and a verified restore run from outside the source tree.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SMOKE = """
import torch, ckptflow
from ckptflow import Checkpointer
model = torch.nn.Linear(4, 2)
with Checkpointer(STORE, "smoke") as ck:
    ck.save(1, {"model": model, "epoch": 3})
    fresh = {"model": torch.nn.Linear(4, 2), "epoch": 0}
    assert ck.restore(fresh).step == 1 and fresh["epoch"] == 3
    assert torch.equal(fresh["model"].weight, model.weight) and ck.verify(1).ok
print(ckptflow.__file__)
"""


def _pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args], check=True, timeout=600)


def _has(venv: Path, dist: str) -> bool:
    code = f"import importlib.metadata as m, sys\ntry: m.version({dist!r})\nexcept m.PackageNotFoundError: sys.exit(1)"
    return subprocess.run([str(venv / "bin" / "python"), "-c", code]).returncode == 0


@pytest.mark.slow  # a fresh venv and pip installs from the package index: make test-e2e
@pytest.mark.timeout(900)
def test_core_install_has_no_dagster_and_saves_and_restores(tmp_path):
    src = tmp_path / "src"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _pip(venv, str(src))
    assert _has(venv, "ckptflow") and _has(venv, "torch")
    for extra in ("dagster", "dagster-aws", "boto3", "pandas"):
        assert not _has(venv, extra), f"a plain install brought {extra}"
    work = tmp_path / "elsewhere"
    work.mkdir()
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", SMOKE.replace("STORE", repr(str(work / "store")))],
        cwd=work,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ""},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert str(venv) in out.stdout  # the installed package, not the source tree
    _pip(venv, f"{src}[s3]")
    assert _has(venv, "boto3") and not _has(venv, "dagster")
