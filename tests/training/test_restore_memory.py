"""Restore holds a bounded amount of host memory beyond the state it restores into.

Each restore runs in a process of its own (``support/restore_rss.py``), whose peak RSS
(VmHWM, reset just before the restore) is its own. Without a bound, a zstd restore (and
any restore from S3) keeps every decoded chunk from the verifying pass to the pass that
writes them: the peak grows by the size of the state. With a 16 MiB budget it must stay
well under half the state here (in flight and kept chunks, plus the allocator's slack).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptflow import Checkpointer
from ckptflow.chunks.budget import MemoryBudget
from support.child_env import child_env

SCRIPT = Path(__file__).parents[1] / "support" / "restore_rss.py"
STATE_MIB = 320
BUDGET_MIB = 16


def _run(*args: str) -> str:
    env = child_env(SCRIPT.parents[2], SCRIPT.parents[1])
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _restore_overhead_mib(url: str, codec: str) -> float:
    _run("save", url, str(STATE_MIB), codec)
    measured = json.loads(_run("restore", url, str(STATE_MIB), str(BUDGET_MIB)).splitlines()[-1])
    assert measured["exact"], "the restored state differs from the one saved"
    assert measured["step"] == (2 if codec == "delta" else 1)
    return measured["peak_mib"] - measured["before_mib"]


@pytest.mark.slow  # a subprocess restoring hundreds of MiB, its peak RSS measured: make test-e2e
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to measure peak RSS")
def test_zstd_restore_holds_at_most_a_budget_beyond_the_state(tmp_path):
    overhead = _restore_overhead_mib(str(tmp_path / "store"), "zstd")
    assert overhead < STATE_MIB / 2, f"restore peaked {overhead:.0f} MiB above the state ({STATE_MIB} MiB)"


@pytest.mark.slow  # a subprocess restoring hundreds of MiB, its peak RSS measured: make test-e2e
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to measure peak RSS")
def test_delta_restore_holds_at_most_a_budget_beyond_the_state(tmp_path):
    """Step 2's chunks are XOR deltas: each decode also reads its base from step 1."""
    root = tmp_path / "store"
    overhead = _restore_overhead_mib(str(root), "delta")
    deltas = _delta_chunks(root, 2)
    assert len(deltas) >= 16, f"step 2 should be stored mostly as deltas, found {len(deltas)}"
    assert overhead < STATE_MIB / 2, f"delta restore peaked {overhead:.0f} MiB above the state ({STATE_MIB} MiB)"


def _delta_chunks(root: Path, step: int) -> list[str]:
    """The chunks of ``step`` stored as deltas (their headers say so, as their manifest does)."""
    from ckptflow.catalog.checkpoints import read_manifest
    from ckptflow.chunks import codecs
    from ckptflow.format.layout import chunk_key
    from ckptflow.store import open_store

    store = open_store(str(root))
    manifest = read_manifest(store, "rss", step)
    heads = {d: store.read_head(chunk_key(d), codecs.HEAD_BYTES) for d in manifest.bases}
    return [d for d, head in heads.items() if codecs.header_codec(head) == "delta"]


@pytest.mark.slow  # a subprocess restoring hundreds of MiB, its peak RSS measured: make test-e2e
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to measure peak RSS")
def test_s3_restore_holds_at_most_a_budget_beyond_the_state(s3_store_url):
    overhead = _restore_overhead_mib(s3_store_url, "raw")
    assert overhead < STATE_MIB / 2, f"restore from S3 peaked {overhead:.0f} MiB above the state ({STATE_MIB} MiB)"


def test_budget_bounds_chunks_in_flight_and_kept():
    budget = MemoryBudget(64)
    with budget.in_flight(16):  # 32 counted: 2 x raw bytes, the in-flight half's whole room
        assert budget.keep(32) and not budget.keep(1)
    with budget.in_flight(1000):  # larger than the room: proceeds alone, counted as the whole room
        pass
    assert budget.peak == 64


def test_budget_refuses_a_negative_size():
    with pytest.raises(ValueError, match="memory budget"):
        MemoryBudget(-1)


def test_staged_restore_in_groups_within_a_small_budget_is_exact(make_ck):
    """Targets that chunks cannot land in directly (not contiguous) are staged; with a
    budget smaller than the state, staging is filled and released group by group."""
    import torch

    saved = {f"t{i}": torch.randn(64, 64) for i in range(8)}  # 16 KiB each, 128 KiB in all
    make_ck(chunk_bytes=4096).save(1, saved, rng=False)
    live = {name: torch.zeros(64, 64).t() for name in saved}  # transposed: not contiguous
    make_ck(restore_buffer_bytes=40 << 10).restore(live, step=1)  # staging room: 20 KiB
    for name, value in saved.items():
        assert torch.equal(live[name], value)


SHORT = Path(__file__).parents[1] / "support" / "short_of_memory.py"


def _short_of_memory(root: str, what: str) -> dict:
    env = child_env(SHORT.parents[2])
    done = subprocess.run(
        [sys.executable, str(SHORT), root, what], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]) if what != "make" else {}


def test_running_short_of_memory_is_not_damage_nothing_falls_back_or_moves_aside(tmp_path):
    """A restore that cannot allocate what a sound manifest declares stops with a clear
    error (no fallback to step 1, no damage recorded); a save of that step again does not
    take the failed check for proof of damage and move the valid commit aside."""
    root = str(tmp_path / "store")
    _short_of_memory(root, "make")
    committed = [(c.step, c.digest) for c in Checkpointer(root, "r").list()]
    restored = _short_of_memory(root, "restore")
    assert restored["error"] == "HostMemoryError", restored
    assert "step 2" in restored["message"] and "not enough host memory" in restored["message"]
    saved = _short_of_memory(root, "save")
    assert saved["error"] in ("CheckpointExistsError", "StoreUnavailableError", "HostMemoryError"), saved
    assert [(c.step, c.digest) for c in Checkpointer(root, "r").list()] == committed
    assert not (tmp_path / "store" / "runs" / "r" / "quarantine").exists()
    assert not (tmp_path / "store" / "damaged").exists()
    with Checkpointer(root, "r") as ck:
        assert ck.verify(2).ok and ck.restore({"w": torch.zeros(16 << 20)}).step == 2
