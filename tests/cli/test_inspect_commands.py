"""The ``ckptflow`` command line, inspection commands: ``ls``, ``verify`` and ``stats``, end
to end over real checkpoints in a temp store, plus one test that runs the installed console
script to prove the entry point works.

Commands run in-process through ``main([...])`` (exit status returned, output captured).
``export``, ``gc`` and argument errors are in cli/test_write_commands.py; the shared helpers are
in tests/support/.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptflow import Checkpointer
from ckptflow.cli import human_bytes
from ckptflow.format import layout as fmt
from support.child_env import child_env
from support.cli import RUN, make_store, run_cli
from support.corrupt import chunk_path, chunks_of, flip_byte, tensor_chunk
from support.states import tensor_bytes, tiny_state


@pytest.fixture
def store(tmp_path):
    """Run ``alpha`` with steps 10 and 20 (training in between); model snapshots and sizes."""
    return make_store(tmp_path)


# ---- ls ----------------------------------------------------------------------------------
def test_ls_table(store, capsys):
    root, _, sizes = store
    code, out, err = run_cli(capsys, "ls", root)
    assert code == 0 and err == ""
    header, *rows = out.strip().splitlines()
    assert header.split() == ["RUN", "STEP", "KIND", "CREATED", "LOGICAL", "STORED", "WRITTEN", "WORLD", "METADATA"]
    assert len(rows) == 2
    for row, step, loss in zip(rows, (10, 20), ("0.5", "0.25")):
        cells = row.split()
        assert cells[:3] == [RUN, str(step), "full"]
        assert human_bytes(sizes[step]) in row  # human sizes, not raw byte counts
        assert f'{{"loss":{loss}}}' in row


def test_ls_json(store, capsys):
    root, _, sizes = store
    code, out, _ = run_cli(capsys, "ls", root, "--json")
    assert code == 0
    docs = json.loads(out)
    assert [(d["run"], d["step"]) for d in docs] == [(RUN, 10), (RUN, 20)]
    for d in docs:
        assert d["kind"] == "full" and d["world_size"] == 1
        assert d["logical_bytes"] == sizes[d["step"]]
        assert d["stored_bytes"] > 0 and d["bytes_written"] > 0
        assert isinstance(d["created_at"], float) and d["created"].endswith("+00:00")
        assert len(d["digest"]) == 64
    assert docs[0]["metadata"] == {"loss": 0.5}


def test_ls_json_is_strict_json_when_a_loss_diverged(tmp_path, capsys):
    """Metadata may hold NaN or infinity (a diverged loss); --json writes null for them, so
    parsers that follow RFC 8259 (jq, JavaScript, Python with parse_constant) read it."""
    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        ck.save(1, {"w": torch.ones(2)}, metadata={"loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1})
    code, out, _ = run_cli(capsys, "ls", root, "--json")

    def refuse(token):
        raise ValueError(f"{token} is not JSON")

    [doc] = json.loads(out, parse_constant=refuse)
    assert code == 0 and doc["metadata"] == {"loss": None, "grad_norm": None, "lr": 0.1}


def test_ls_filters_by_run(store, capsys):
    root, _, _ = store
    with Checkpointer(root, "beta") as ckpt:
        ckpt.save(1, tiny_state(1))
    _, out, _ = run_cli(capsys, "ls", root, "--json")
    assert {d["run"] for d in json.loads(out)} == {RUN, "beta"}
    code, out, _ = run_cli(capsys, "ls", root, "--run", "beta", "--json")
    assert code == 0 and [(d["run"], d["step"]) for d in json.loads(out)] == [("beta", 1)]


def test_ls_empty_store(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, out, _ = run_cli(capsys, "ls", tmp_path / "empty", "--json")
    assert code == 0 and json.loads(out) == []


# ---- verify ------------------------------------------------------------------------------
def test_verify_clean(store, capsys):
    root, _, _ = store
    code, out, _ = run_cli(capsys, "verify", root, "--run", RUN)
    assert code == 0 and out.startswith("OK") and "step 20" in out  # default: latest step
    code, out, _ = run_cli(capsys, "verify", root, "--run", RUN, "--step", "10")
    assert code == 0 and "step 10" in out
    code, out, _ = run_cli(capsys, "verify", root, "--run", RUN, "--all")
    assert code == 0 and "2 checkpoints verified" in out


def test_verify_corrupt_reports_one_line_per_problem(store, capsys):
    root, _, _ = store
    only20 = set(chunks_of(root, RUN, 20)) - set(chunks_of(root, RUN, 10))
    flipped = tensor_chunk(root, RUN, 20, "model.0.weight")
    removed = tensor_chunk(root, RUN, 20, "model.2.weight")
    assert {flipped, removed} <= only20
    flip_byte(chunk_path(root, flipped))
    chunk_path(root, removed).unlink()

    code, out, err = run_cli(capsys, "verify", root, "--run", RUN)
    assert code == 1
    lines = out.strip().splitlines()
    assert len(lines) == 2
    assert all(line.startswith(f"run {RUN} step 20: ") for line in lines)
    assert any(flipped in line and "does not match its address" in line for line in lines)
    assert any(removed[:16] in line and "missing" in line for line in lines)
    assert "2 problem(s)" in err

    code, _, _ = run_cli(capsys, "verify", root, "--run", RUN, "--step", "10")
    assert code == 0  # the older checkpoint shares none of the damaged chunks
    code, out, _ = run_cli(capsys, "verify", root, "--run", RUN, "--all")
    assert code == 1 and len(out.strip().splitlines()) == 2


def test_verify_corrupt_manifest(store, capsys):
    root, _, _ = store
    path = Path(root) / fmt.manifest_key(RUN, 20)
    path.write_bytes(path.read_bytes().replace(b'"loss":0.25', b'"loss":0.26'))
    code, out, _ = run_cli(capsys, "verify", root, "--run", RUN)  # the corrupt newest, not step 10
    assert code == 1 and out.startswith(f"run {RUN} step 20: ") and "checksum" in out


def test_verify_all_reports_uncommitted_steps(store, capsys):
    root, _, _ = store
    (Path(root) / fmt.manifest_key(RUN, 10)).unlink()  # rank record stays: a crashed save
    code, out, _ = run_cli(capsys, "verify", root, "--run", RUN, "--all")
    assert code == 1
    (line,) = out.strip().splitlines()
    assert line.startswith(f"run {RUN} step 10: uncommitted")
    code, _, _ = run_cli(capsys, "verify", root, "--run", RUN)  # latest only: still fine
    assert code == 0


# ---- stats -------------------------------------------------------------------------------
def test_stats_dedup_across_runs(tmp_path, capsys):
    root = str(tmp_path / "store")
    weights = tiny_state(7, optimizer=False)
    logical = tensor_bytes(weights)
    with Checkpointer(root, "a") as ckpt:
        ckpt.save(1, weights)
        ckpt.save(2, weights)  # unchanged weights: dedup within the run
    with Checkpointer(root, "b") as ckpt:
        ckpt.save(1, weights)  # identical weights from another run: dedup across runs
    code, out, _ = run_cli(capsys, "stats", root, "--json")
    assert code == 0
    doc = json.loads(out)
    runs = {r["run"]: r for r in doc["runs"]}
    assert runs["a"]["checkpoints"] == 2 and runs["a"]["logical_bytes"] == 2 * logical
    assert runs["a"]["unique_bytes"] == logical and runs["a"]["dedup_ratio"] == 2.0
    assert runs["b"]["logical_bytes"] == logical and runs["b"]["dedup_ratio"] == 1.0
    s = doc["store"]
    assert s["logical_bytes"] == 3 * logical and s["unique_bytes"] == logical
    assert s["dedup_ratio"] == 3.0 > 1
    assert s["stored_bytes"] == s["chunk_file_bytes"] == runs["a"]["stored_bytes"] == runs["b"]["stored_bytes"]
    assert s["compression_ratio"] == pytest.approx(logical / s["stored_bytes"]) and s["compression_ratio"] < 1
    assert s["unreferenced_chunks"] == 0 and s["chunk_files"] == len(chunks_of(root, "b", 1))

    code, out, _ = run_cli(capsys, "stats", root)
    assert code == 0
    store_row = [line for line in out.splitlines() if line.startswith("(store)")][0]
    assert "3.00x" in store_row
    assert "unreferenced: 0" in out


def test_stats_compression_and_unreferenced(tmp_path, capsys):
    root = str(tmp_path / "store")
    with Checkpointer(root, "z", codec="zstd") as ckpt:
        ckpt.save(1, {"model": {"w": torch.zeros(4096)}})
        ckpt.save(2, {"model": {"w": torch.ones(4096)}})
    (Path(root) / fmt.manifest_key("z", 1)).unlink()
    code, out, _ = run_cli(capsys, "stats", root, "--json")
    doc = json.loads(out)
    (run,) = doc["runs"]
    assert run["checkpoints"] == 1 and run["logical_bytes"] == 4096 * 4
    assert run["compression_ratio"] > 10
    assert doc["store"]["unreferenced_chunks"] == 1 and doc["store"]["unreferenced_bytes"] > 0


def test_stats_counts_as_garbage_only_what_gc_would_sweep_past_a_damaged_commit_record(tmp_path, capsys):
    root = str(tmp_path / "store")
    with Checkpointer(root, "z") as ckpt:
        ckpt.save(1, {"model": {"w": torch.zeros(4096)}})
        ckpt.save(2, {"model": {"w": torch.ones(4096)}})
    manifest = Path(root) / fmt.manifest_key("z", 2)
    manifest.write_bytes(manifest.read_bytes().replace(b'"step":2', b'"step":3'))  # fails its checksum, still JSON
    code, out, err = run_cli(capsys, "stats", root)
    assert code == 0 and "not counted: run z step 2" in err
    assert "unreferenced: 0 (0 B)" in out and "reclaimable" not in out  # GC keeps what the record still names
    assert run_cli(capsys, "gc", root, "--grace", "0s", "--force", "--dry-run")[1].startswith("would delete 0 object")
    manifest.write_bytes(b"{")  # its chunks cannot be told: GC sweeps nothing, so nothing is reclaimable
    code, out, err = run_cli(capsys, "stats", root)
    assert code == 0 and "unreferenced: 1 (" in out
    assert "not reclaimable while a commit record's chunks cannot be told" in out and "reclaimable with" not in out
    assert run_cli(capsys, "gc", root, "--grace", "0s", "--force")[0] == 1


def test_stats_counts_the_chunks_recorded_damaged_until_a_save_writes_them_anew(store, capsys):
    root, _, _ = store
    flip_byte(chunk_path(root, tensor_chunk(root, RUN, 10, "model.0.weight")))
    assert run_cli(capsys, "verify", root, "--run", RUN, "--all")[0] == 1  # records what it refused
    code, out, err = run_cli(capsys, "stats", root, "--json")
    assert code == 0 and json.loads(out)["store"]["damaged_chunks"] == 1
    code, out, err = run_cli(capsys, "stats", root)
    assert "1 chunk object(s) are recorded damaged" in err and "verify --all" in err


# ---- installed console script ------------------------------------------------------------
def _console_script() -> str:
    candidate = Path(sys.executable).parent / "ckptflow"
    found = str(candidate) if candidate.exists() else shutil.which("ckptflow")
    if not found:
        pytest.fail("the ckptflow console script is not installed (pip install -e .)")
    return found


def test_console_script(store):
    root, _, _ = store
    exe = _console_script()
    proc = subprocess.run([exe, "ls", root, "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [d["step"] for d in json.loads(proc.stdout)] == [10, 20]
    flip_byte(chunk_path(root, tensor_chunk(root, RUN, 10, "model.0.weight")))
    proc = subprocess.run([exe, "verify", root, "--run", RUN, "--all"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout.startswith(f"run {RUN} step 10: ")
    assert "%|" not in proc.stderr and "Traceback" not in proc.stderr  # a pipe: no progress bar


@pytest.mark.parametrize(
    "command",
    [
        ["--help"],
        ["ls", "{root}"],
        ["stats", "{root}"],
        ["verify", "{root}", "--run", RUN],
        ["gc", "{root}", "--grace", "1h", "--dry-run"],
    ],
)
def test_inspecting_commands_do_not_import_torch(store, command):
    """torch costs seconds to import; listing, verifying and collecting a store need none of it."""
    argv = [a.format(root=store[0]) for a in command]
    code = f"import sys; from ckptflow.cli import main; main({argv!r}); assert 'torch' not in sys.modules, 'torch'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=child_env(Path(__file__).parents[2]))  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]


@contextlib.contextmanager
def as_another_user(path: Path) -> Iterator[None]:
    """This process unable to read ``path`` (a directory): mode 000, and for root (which
    permissions do not stop) its effective uid that of ``nobody`` meanwhile."""
    path.chmod(0)
    try:
        if os.geteuid() != 0:
            yield
            return
        os.setegid(NOBODY)
        os.seteuid(NOBODY)
        try:
            yield
        finally:
            os.seteuid(0)
            os.setegid(0)
    finally:
        path.chmod(0o755)


NOBODY = 65534


def test_a_store_it_may_not_read_asks_for_read_access_not_write_access(capsys):
    """``stats`` only reads the store: refused a read of its chunks directory, it said 'this
    command needs write access there ... run it as a user who may write to the store, or on a
    writable copy', which no user who may not read it can act on."""
    where = Path(tempfile.mkdtemp(prefix="ckptflow-unreadable-"))  # not under tmp_path: ``nobody`` must reach it
    try:
        where.chmod(0o755)
        root, _, _ = make_store(where)
        assert run_cli(capsys, "stats", root)[0] == 0  # readable, it reports
        with as_another_user(Path(root) / "chunks"):
            code, out, err = run_cli(capsys, "stats", root)
        assert code == 2 and out == "" and err.count("\n") == 1
        assert f"Permission denied: {root}/chunks" in err
        assert "write" not in err and "may read the store" in err, err
    finally:
        shutil.rmtree(where)
