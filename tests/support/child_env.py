"""The environment of a child Python process a test starts: this checkout first on its
path, then whatever ``PYTHONPATH`` the test run itself had (a machine that provides
packages that way, as the GPU machine's wheels folder does, still provides them)."""

from __future__ import annotations

import os
from pathlib import Path


def child_env(*paths: str | Path, **extra: str) -> dict[str, str]:
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join([*(str(p) for p in paths), *inherited])}
