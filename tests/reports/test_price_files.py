"""A price file (``reports.costs.read_cost_model``), as ``stats --prices FILE`` and the Dagster
``CKPTFLOW_PRICES`` read it: any file that reads, bounded. ``--prices /dev/stdin`` or a pipe
was refused ('not a regular file'), and ``CKPTFLOW_PRICES=/dev/zero`` was read without end.

The unbounded read is tried in a child process with its address space capped, so without
the bound it fails (a MemoryError) rather than take the machine's memory
(``support.config_files``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from ckptflow.errors import CkptflowError
from ckptflow.reports.costs import MAX_PRICES_BYTES
from support.child_env import child_env
from support.cli import make_store, run_cli
from support.config_files import REPO, capped_python, load_error_from_unwritten_fifo

PRICES = {"prices": {"ONPREM": 0.5}, "tiers": {"hot": "ONPREM"}}


@pytest.fixture
def fifo(tmp_path):
    """A named pipe whose writer (a thread) writes the price list once the pipe is opened."""
    path = tmp_path / "prices.fifo"
    os.mkfifo(path)
    writer = threading.Thread(target=lambda: path.write_text(json.dumps(PRICES)), daemon=True)
    writer.start()
    yield path
    writer.join(timeout=10)


FROM_ENV = "from resources import PricingResource; print(PricingResource.from_env().hot_class)"


def test_ckptflow_prices_dev_zero_is_refused_at_once_with_what_to_do():
    done = capped_python(FROM_ENV, CKPTFLOW_PRICES="/dev/zero")
    assert done.returncode == 1 and "MemoryError" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"CKPTFLOW_PRICES=/dev/zero: it holds more than {MAX_PRICES_BYTES} bytes" in last, last
    assert "name a JSON file such as" in last, last


def test_ckptflow_prices_may_name_a_pipe(fifo, monkeypatch):
    from resources import PricingResource

    monkeypatch.setenv("CKPTFLOW_PRICES", str(fifo))
    pricing = PricingResource.from_env()
    assert pricing.hot_class == "ONPREM" and pricing.prices["ONPREM"] == 0.5


def test_prices_dev_zero_is_refused_at_once(tmp_path):
    root, _, _ = make_store(tmp_path)
    code = f"import sys; from ckptflow.cli import main; sys.exit(main(['stats', {root!r}, '--prices', '/dev/zero']))"
    done = capped_python(code)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert f"--prices /dev/zero: it holds more than {MAX_PRICES_BYTES} bytes" in done.stderr


def test_prices_may_be_a_pipe(tmp_path, fifo, capsys):
    root, _, _ = make_store(tmp_path)
    code, out, err = run_cli(capsys, "stats", root, "--prices", fifo)
    assert code == 0, err
    assert "ONPREM" in out and "0.5" in out


def test_prices_from_stdin(tmp_path):
    """``--prices /dev/stdin``, a price list piped in (or ``<(...)``: a pipe too)."""
    root, _, _ = make_store(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "ckptflow", "stats", root, "--prices", "/dev/stdin"],
        input=json.dumps(PRICES),
        env=child_env(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "ONPREM" in done.stdout


def test_ckptflow_prices_naming_a_fifo_no_process_writes_stops_the_load_with_why(tmp_path, monkeypatch):
    """``open`` of a FIFO with no writer blocks until one comes: the code location's load
    hung there, saying nothing."""
    from resources import PricingResource

    fifo, error = load_error_from_unwritten_fifo(tmp_path, monkeypatch, "CKPTFLOW_PRICES", PricingResource.from_env)
    assert isinstance(error, CkptflowError), error
    assert f"CKPTFLOW_PRICES={fifo}: it was not read to its end within 0.5 s" in str(error), error
    assert "name a JSON file such as" in str(error), error
