"""The integrations are optional extras: the library imports without Lightning or
transformers, and an integration imported without its framework says which extra to install."""

from __future__ import annotations

import subprocess
import sys

WITHOUT = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"transformers", "pytorch_lightning", "lightning_fabric", "lightning", "accelerate"}:
            raise ImportError(f"No module named {name!r} (hidden by the test)")
sys.meta_path.insert(0, Absent())
import ckptflow, ckptflow.interop.importers, ckptflow.interop.export, ckptflow.cli, ckptflow.integrations
for name, extra in (("lightning", "lightning"), ("hf", "hf")):
    try:
        __import__(f"ckptflow.integrations.{name}")
    except ImportError as e:
        assert f"pip install 'ckptflow[{extra}]'" in str(e), str(e)
    else:
        raise AssertionError(f"ckptflow.integrations.{name} imported without its framework")
print("ok")
"""


def test_library_imports_without_the_frameworks():
    out = subprocess.run([sys.executable, "-c", WITHOUT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
