"""The layers of docs/design.md, enforced: import-linter's contracts (pyproject.toml) hold, they
fail on an upward import, no two modules import each other, and the training path loads
only what it needs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ["ckptflow", "assets", "sensors", "resources", "pipelines"]
UPPER = ("ckptflow.lifecycle", "ckptflow.reports", "ckptflow.interop", "ckptflow.cli", "ckptflow.integrations")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))",
        ],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_import_contracts_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


@pytest.fixture(scope="module")
def copy_of_the_code(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layers")
    for name in ROOTS:
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root)
    return root


@pytest.mark.parametrize(
    ("module", "upward_import", "broken"),
    [
        (
            "ckptflow/training/state.py",
            "from ckptflow.lifecycle import promote",
            "ckptflow.training.state -> ckptflow.lifecycle",
        ),
        (
            "ckptflow/format/layout.py",
            "from ckptflow.catalog import gc",
            "ckptflow.format.layout -> ckptflow.catalog.gc",
        ),
        ("ckptflow/store/base.py", "import dagster", "ckptflow.store.base -> dagster"),
        ("sensors/landing.py", "from ckptflow.cli import output", "sensors.landing -> ckptflow.cli"),
    ],
)
def test_an_upward_import_breaks_a_contract(copy_of_the_code: Path, module: str, upward_import: str, broken: str):
    path = copy_of_the_code / module
    original = path.read_text()
    path.write_text(original + f"\n{upward_import}  # deliberately upward\n")
    try:
        result = lint_imports(copy_of_the_code)
    finally:
        path.write_text(original)
    assert result.returncode == 1, result.stdout
    assert broken in result.stdout


def test_no_two_modules_import_each_other():
    """A cycle between modules inside one layer is invisible to the layers contract."""
    graph = grimp.build_graph("ckptflow")
    modules = sorted(m for m in graph.modules if m != "ckptflow")
    edges = {m: {n for n in graph.find_modules_directly_imported_by(m) if n != "ckptflow"} for m in modules}
    for package in modules:  # a package's own __init__ re-exporting a child is not a cycle
        edges[package] -= {m for m in graph.find_children(package)}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in edges.get(m, ()):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for m in modules:
        if m not in index:
            visit(m)
    assert cycles == []


def loaded_by(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stderr
    return [
        line.rsplit("|", 1)[1].strip() for line in out.splitlines() if line.startswith("import time:") and "|" in line
    ]


@pytest.mark.parametrize(
    "code",
    [
        "import ckptflow.training",
        "from ckptflow import Checkpointer, SavePolicy, open_store",
        "import ckptflow.training.restore",
    ],
)
def test_the_training_path_loads_no_lifecycle_reports_interop_or_dagster(code: str):
    loaded = loaded_by(code)
    assert "ckptflow.training.checkpointer" in loaded or "ckptflow.training.restore" in loaded
    assert [
        m for m in loaded if m.startswith(UPPER) or m.split(".")[0] in {"dagster", "pandas", "assets", "sensors"}
    ] == []
