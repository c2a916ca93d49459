"""The ``ckptflow`` command line, end to end over real checkpoints in a temp store.

Commands run in-process through ``main([...])`` (exit status returned, output
captured); one test runs the installed console script to prove the entry point works.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ckptflow import Checkpointer
from ckptflow import format as fmt
from ckptflow.catalog import read_manifest
from ckptflow.cli import human_bytes, main
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


def all_files(root: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in Path(root).rglob("*") if p.is_file()}


@pytest.fixture
def store(tmp_path):
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


def test_ls_filters_by_run(store, capsys):
    root, _, _ = store
    with Checkpointer(root, "beta") as ckpt:
        ckpt.save(1, make_state(1))
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
    flip_last_byte(chunk_path(root, flipped))
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


# ---- export ------------------------------------------------------------------------------
def test_export_is_exact(store, tmp_path, capsys):
    root, snaps, _ = store
    out_file = tmp_path / "model.safetensors"
    code, out, _ = run_cli(capsys, "export", root, "--run", RUN, "--step", "10", "--out", out_file)
    assert code == 0 and "step 10" in out
    loaded = load_file(str(out_file))
    assert loaded.keys() == snaps[10].keys()
    for name, tensor in snaps[10].items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(out_file), "pt") as f:
        meta = f.metadata()
    assert meta["ckptflow.run"] == RUN and meta["ckptflow.step"] == "10"
    assert meta["ckptflow.manifest_digest"] == read_manifest(open_store(root), RUN, 10)[1]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_export_default_latest_and_bf16(store, tmp_path, capsys):
    root, snaps, _ = store
    out_file = tmp_path / "model-bf16.safetensors"
    code, out, _ = run_cli(capsys, "export", root, "--run", RUN, "--out", out_file, "--dtype", "bf16")
    assert code == 0 and "step 20" in out
    loaded = load_file(str(out_file))
    assert loaded.keys() == snaps[20].keys()
    for name, tensor in snaps[20].items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16)), name


def test_export_default_skips_checkpoint_that_does_not_verify(store, tmp_path, capsys):
    root, snaps, _ = store
    flip_last_byte(chunk_path(root, tensor_chunk(root, RUN, 20, "optim.state.0.weight.exp_avg")))
    out_file = tmp_path / "m.safetensors"
    code, out, err = run_cli(capsys, "export", root, "--run", RUN, "--out", out_file)
    assert code == 0 and "step 10" in out
    assert f"run {RUN} step 20 does not verify" in err
    loaded = load_file(str(out_file))
    assert all(torch.equal(loaded[k], v) for k, v in snaps[10].items())


def test_export_of_corrupt_step_fails_cleanly(store, tmp_path, capsys):
    root, _, _ = store
    flip_last_byte(chunk_path(root, tensor_chunk(root, RUN, 20, "model.0.bias")))
    out_file = tmp_path / "m.safetensors"
    code, _, err = run_cli(capsys, "export", root, "--run", RUN, "--step", "20", "--out", out_file)
    assert code == 2 and err.startswith("ckptflow: error:") and "does not match its address" in err
    assert not out_file.exists() and list(tmp_path.glob("m.safetensors*")) == []


# ---- stats -------------------------------------------------------------------------------
def test_stats_dedup_across_runs(tmp_path, capsys):
    root = str(tmp_path / "store")
    weights = make_state(7, optimizer=False)
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


# ---- gc ----------------------------------------------------------------------------------
def test_gc_dry_run_deletes_nothing(store, capsys):
    root, _, _ = store
    doomed = set(chunks_of(root, RUN, 10)) - set(chunks_of(root, RUN, 20))
    (Path(root) / fmt.manifest_key(RUN, 10)).unlink()
    before = all_files(root)
    code, out, _ = run_cli(capsys, "gc", root, "--grace", "0s", "--dry-run", "-v")
    assert code == 0 and all_files(root) == before
    assert out.startswith(f"would delete {len(doomed) + 1} object(s)")  # + step 10's rank record
    listed = {line.split()[0] for line in out.splitlines()[1:]}
    assert {fmt.chunk_key(d) for d in doomed} | {fmt.rank_key(RUN, 10, 0)} == listed


def test_gc_deletes_unreferenced_chunks(store, capsys):
    root, _, _ = store
    doomed = set(chunks_of(root, RUN, 10)) - set(chunks_of(root, RUN, 20))
    (Path(root) / fmt.manifest_key(RUN, 10)).unlink()
    assert doomed
    code, out, _ = run_cli(capsys, "gc", root, "--grace", "1h")
    assert code == 0 and out.startswith("deleted 0 object(s)")  # everything is younger than 1h
    code, out, _ = run_cli(capsys, "gc", root, "--grace", "0")
    assert code == 0 and out.startswith(f"deleted {len(doomed) + 1} object(s)")
    assert not any(chunk_path(root, d).exists() for d in doomed)
    assert all(chunk_path(root, d).exists() for d in chunks_of(root, RUN, 20))
    assert run_cli(capsys, "verify", root, "--run", RUN, "--all")[0] == 0


def test_gc_sweeps_nothing_while_a_save_holds_a_lease(store, capsys):
    root, _, _ = store
    doomed = set(chunks_of(root, RUN, 10)) - set(chunks_of(root, RUN, 20))
    (Path(root) / fmt.manifest_key(RUN, 10)).unlink()
    hours_ago = time.time() - 7200
    for path in Path(root).rglob("*"):
        os.utime(path, (hours_ago, hours_ago))
    lease = Path(root) / "locks" / "leases" / "live-save.json"  # a save writing chunks now
    lease.parent.mkdir(parents=True)
    lease.write_text("{}")
    code, _, err = run_cli(capsys, "gc", root, "--grace", "1h", "--wait", "0")
    assert code == 1 and "save(s) are writing chunks" in err
    assert all(chunk_path(root, d).exists() for d in doomed)
    assert not (Path(root) / "locks" / "gc.json").exists(), "gc released its lock"
    lease.unlink()
    assert run_cli(capsys, "gc", root, "--grace", "1h", "--wait", "0")[0] == 0
    assert not any(chunk_path(root, d).exists() for d in doomed)


# ---- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, expect",
    [
        (["verify", "{root}", "--run", "../etc"], "is not allowed"),
        (["verify", "{root}", "--run", "nope"], "no run 'nope'"),
        (["ls", "{root}", "--run", "nope"], "no run 'nope'"),
        (["export", "{root}", "--run", "nope", "--out", "{tmp}/m.st"], "no run 'nope'"),
        (["verify", "{root}/missing", "--run", RUN], "does not exist"),
        (["verify", "{root}", "--run", RUN, "--step", "7"], "has no step 7"),
        (["verify", "{root}", "--run", RUN, "--step", "10", "--all"], "not allowed with argument"),
        (["verify", "{root}"], "--run"),
        (["gc", "{root}", "--grace", "soon"], "not understood"),
        (["gc", "{root}", "--grace=-1h"], "negative"),
        (["gc", "{root}"], "--grace"),
        (["export", "{root}", "--run", RUN, "--out", "{tmp}/m.st", "--key", "ema"], "no tensors under 'ema.'"),
        (["export", "{root}", "--run", RUN, "--out", "{tmp}/m.st", "--step", "15"], "never committed"),
        (["export", "{root}", "--run", RUN, "--out", "{tmp}/no/dir/m.st"], "does not exist"),
        (["export", "{root}", "--run", RUN, "--out", "{tmp}/m.st", "--dtype", "int8"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_errors_are_one_line_and_exit_2(store, tmp_path, capsys, argv, expect):
    root, _, _ = store
    code, out, err = run_cli(capsys, *[a.format(root=root, tmp=tmp_path) for a in argv])
    assert code == 2
    assert err.startswith("ckptflow: error: ") and err.count("\n") == 1, err
    assert expect in err and "Traceback" not in err
    assert not (Path(root) / "missing").exists()  # inspecting never creates a store


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
    flip_last_byte(chunk_path(root, tensor_chunk(root, RUN, 10, "model.0.weight")))
    proc = subprocess.run([exe, "verify", root, "--run", RUN, "--all"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout.startswith(f"run {RUN} step 10: ")
    assert "%|" not in proc.stderr and "Traceback" not in proc.stderr  # a pipe: no progress bar


# ---- sharded checkpoint ------------------------------------------------------------------
SHARDED_SAVE = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from safetensors.torch import save_file

    from ckptflow import Checkpointer

    def worker(rank, root, init):
        dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        w, b = torch.randn(10, 6), torch.randn(6)
        state = {"model": {"w": distribute_tensor(w, mesh, [Shard(0)]), "b": b}}
        with Checkpointer(root, "sharded") as ckpt:
            ckpt.save(3, state)
        if rank == 0:
            save_file({"w": w, "b": b}, root + "/../expected.safetensors")
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1], sys.argv[2]), nprocs=2)
    """
)


def test_export_consolidates_two_shards(tmp_path, capsys):
    root = tmp_path / "store"
    root.mkdir()
    script = tmp_path / "save_sharded.py"
    script.write_text(SHARDED_SAVE)
    proc = subprocess.run(
        [sys.executable, str(script), str(root), str(tmp_path / "pg-init")],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest, _ = read_manifest(open_store(str(root)), "sharded", 3)
    assert manifest["world_size"] == 2 and len(manifest["dcp"]["tensors"]["model.w"]["chunks"]) == 2
    out_file = tmp_path / "m.safetensors"
    code, _, err = run_cli(capsys, "export", root, "--run", "sharded", "--out", out_file)
    assert code == 0, err
    expected = load_file(str(tmp_path / "expected.safetensors"))
    loaded = load_file(str(out_file))
    assert loaded.keys() == {"w", "b"}
    assert torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["b"], expected["b"])
