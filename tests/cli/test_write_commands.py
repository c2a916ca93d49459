"""The ``ckptflow`` command line, commands that write: ``export`` (exact, bf16, skipping or
failing on corrupt checkpoints, consolidating a two-rank sharded checkpoint) and ``gc``
(dry run, deletion, leases), plus the one-line exit-2 errors of every command.

Commands run in-process through ``main([...])`` (exit status returned, output captured).
``ls``, ``verify``, ``stats`` and the console script are in cli/test_inspect_commands.py; the shared helpers
are in tests/support/.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckptflow import Checkpointer
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.format import layout as fmt
from ckptflow.store import open_store
from support.cli import RUN, make_store, run_cli
from support.corrupt import chunk_path, chunks_of, flip_byte, rank_files, tensor_chunk
from support.refused import unwritable


@pytest.fixture
def store(tmp_path):
    """Run ``alpha`` with steps 10 and 20 (training in between); model snapshots and sizes."""
    return make_store(tmp_path)


def all_files(root: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in Path(root).rglob("*") if p.is_file()}


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
    assert meta["ckptflow.manifest_digest"] == read_manifest(open_store(root), RUN, 10).digest
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
    flip_byte(chunk_path(root, tensor_chunk(root, RUN, 20, "optim.state.0.weight.exp_avg")))
    out_file = tmp_path / "m.safetensors"
    code, out, err = run_cli(capsys, "export", root, "--run", RUN, "--out", out_file)
    assert code == 0 and "step 10" in out
    assert f"run {RUN} step 20 does not verify" in err
    loaded = load_file(str(out_file))
    assert all(torch.equal(loaded[k], v) for k, v in snaps[10].items())


def test_export_of_corrupt_step_fails_cleanly(store, tmp_path, capsys):
    root, _, _ = store
    flip_byte(chunk_path(root, tensor_chunk(root, RUN, 20, "model.0.bias")))
    out_file = tmp_path / "m.safetensors"
    code, _, err = run_cli(capsys, "export", root, "--run", RUN, "--step", "20", "--out", out_file)
    assert code == 2 and err.startswith("ckptflow: error:") and "does not match its address" in err
    assert not out_file.exists() and list(tmp_path.glob("m.safetensors*")) == []


@pytest.mark.parametrize("damaged", ["chunk", "manifest"])
@pytest.mark.parametrize("form", ["hf", "dcp"])
def test_export_of_a_damaged_step_says_what_to_do(store, tmp_path, capsys, damaged, form):
    root, _, _ = store
    if damaged == "chunk":
        flip_byte(chunk_path(root, tensor_chunk(root, RUN, 20, "model.0.bias")))
    else:
        manifest = Path(root) / fmt.manifest_key(RUN, 20)
        manifest.write_bytes(manifest.read_bytes().replace(b'"step":20', b'"step":21'))
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", root, "--run", RUN, "--step", "20", "--out", out, "--format", form)
    assert code == 2 and not out.exists()
    assert err.startswith(f"ckptflow: error: run '{RUN}' step 20 cannot be exported: ") and err.count("\n") == 1
    assert "nothing was written: export another step (without --step: the newest that verifies)" in err
    assert ("ckptflow repair ROOT --from URL" in err) == (damaged == "chunk")  # repair copies chunks, not records


def test_export_of_an_entry_without_tensors_names_the_entries_that_have_them(tmp_path, capsys):
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        ck.save(1, {"model": {"w": torch.ones(4)}, "data": {"position": 3}})  # "data": plain JSON, no tensor
    code, _, err = run_cli(capsys, "export", root, "--run", RUN, "--key", "data", "--out", tmp_path / "m.safetensors")
    assert code == 2 and not (tmp_path / "m.safetensors").exists()
    assert "has no tensors under 'data.'; its tensors are under ['model']: pass one of those as --key" in err  # was
    # "its state holds ['model']", which it does not alone


def test_a_refused_import_into_a_new_root_leaves_no_store_behind(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    save_file({"w": torch.ones(4)}, tmp_path / "w.safetensors")
    torch.save({"model": {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}}, tmp_path / "clash.pt")
    root = tmp_path / "new-store"
    for run, src, expect in (
        ("r", tmp_path / "notes.txt", "is none of what ckptflow imports"),
        ("r", tmp_path / "missing.pt", "does not exist"),
        ("bad/run", tmp_path / "w.safetensors", "run name 'bad/run' is not allowed"),
        ("r", tmp_path / "clash.pt", "two tensors of the state flatten to the name 'model.a.b'"),  # the save's refusal
    ):
        code, _, err = run_cli(capsys, "import", root, "--run", run, "--step", "1", src)
        assert code == 2 and expect in err
        assert not root.exists()  # was an empty store directory after every refusal
    code, out, _ = run_cli(capsys, "import", root, "--run", "r", "--step", "1", tmp_path / "w.safetensors")
    assert code == 0 and "as run r step 1" in out and (root / fmt.manifest_key("r", 1)).is_file()
    code, _, err = run_cli(capsys, "import", root, "--run", "r", "--step", "1", tmp_path / "w.safetensors")
    assert code == 2 and "already committed" in err and "nothing was written" in err
    assert "or expire it first (ckptflow.lifecycle.expire" in err and "ckptflow gc" not in err  # gc keeps commits


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
    assert {fmt.chunk_key(d) for d in doomed} | rank_files(root, RUN, 10) == listed


def test_gc_deletes_unreferenced_chunks(store, capsys):
    root, _, _ = store
    doomed = set(chunks_of(root, RUN, 10)) - set(chunks_of(root, RUN, 20))
    (Path(root) / fmt.manifest_key(RUN, 10)).unlink()
    assert doomed
    code, out, _ = run_cli(capsys, "gc", root, "--grace", "1h")
    assert code == 0 and out.startswith("deleted 0 object(s)")  # everything is younger than 1h
    before = all_files(root)
    code, _, err = run_cli(capsys, "gc", root, "--grace", "0")  # unsafe for writes without a save lease
    assert code == 2 and "--force" in err and "save still running" in err
    assert all_files(root) == before
    code, out, _ = run_cli(capsys, "gc", root, "--grace", "0", "--force")
    assert code == 0 and out.startswith(f"deleted {len(doomed) + 1} object(s)")
    assert not any(chunk_path(root, d).exists() for d in doomed)
    assert all(chunk_path(root, d).exists() for d in chunks_of(root, RUN, 20))
    assert run_cli(capsys, "verify", root, "--run", RUN, "--all")[0] == 0


def test_gc_does_not_claim_to_keep_the_chunks_of_a_record_it_cannot_parse(store, capsys):
    root, _, _ = store
    (Path(root) / fmt.manifest_key(RUN, 10)).write_bytes(b"{")  # fails its checksum and is not JSON
    before = all_files(root)
    code, out, err = run_cli(capsys, "gc", root, "--grace", "1h")
    assert code == 1 and out == "" and all_files(root) == before
    assert f"run {RUN} step 10" in err and "its chunks cannot be told" in err
    assert "GC keeps the chunks its JSON still names" not in err  # was said of this record, which has no JSON
    (Path(root) / fmt.manifest_key(RUN, 10)).write_bytes(b'{"chunks": {}}')  # JSON: GC keeps what it names
    code, _, err = run_cli(capsys, "gc", root, "--grace", "1h")
    assert code == 0 and "GC keeps the chunks its JSON still names" in err


def test_a_store_it_may_not_write_to_is_named_with_what_to_do(store, capsys):
    root, _, _ = store
    before = all_files(root)
    with unwritable(Path(root)):
        code, out, err = run_cli(capsys, "gc", root, "--grace", "1h")
    assert code == 2 and out == "" and all_files(root) == before
    assert err.startswith("ckptflow: error: ") and err.count("\n") == 1 and "[Errno" not in err  # was
    # "ckptflow: error: [Errno 1] Operation not permitted: '.../locks'"
    assert f"{root}/locks" in err and "this command needs write access there" in err


def test_an_export_to_a_directory_it_may_not_write_to_names_that_place_not_the_store(store, tmp_path, capsys):
    root, _, _ = store
    out_dir = tmp_path / "read-only"
    out_dir.mkdir()
    with unwritable(out_dir):
        code, out, err = run_cli(capsys, "export", root, "--run", RUN, "--out", out_dir / "m.safetensors")
    assert code == 2 and out == "" and list(out_dir.iterdir()) == []
    assert err.startswith(f"ckptflow: error: Operation not permitted: {out_dir}/") or "Permission denied" in err
    assert "write access to the store" not in err and "a user who may write to the store" not in err  # was
    # "run it as a user who may write to the store, or on a writable copy": the store was never written
    assert "pass an --out it may write" in err


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
    code, out, err = run_cli(capsys, "gc", root, "--grace", "1h", "--dry-run", "-v")  # says what it would do
    assert code == 1 and "a gc now would sweep nothing: 1 save(s) are writing chunks" in err
    assert out.startswith(f"would delete {len(doomed) + 1} object(s)") and all(d in out for d in doomed)
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
        (["verify", "{root}", "--run", RUN, "--step", "7"], "run 'alpha' has no step 7 (steps: 10, 20)"),
        (["ls", "{root}", "--run", RUN, "--select", "7"], "run 'alpha' has no step 7 (steps: 10, 20)"),  # was exit 0
        (["verify", "{root}", "--run", RUN, "--step", "10", "--all"], "not allowed with argument"),
        (["verify", "{root}"], "--run"),
        (["gc", "{root}", "--grace", "soon"], "not understood"),
        (["gc", "{root}", "--grace=-1h"], "argument --grace: '-1h' is negative"),
        (["advise", "{root}", "--run", RUN, "--mtbf=-6h"], "argument --mtbf: '-6h' is negative"),  # was "grace"
        (["gc", "{root}", "--grace", "nan"], "not a finite number"),  # NaN compares false: would protect nothing
        (["gc", "{root}", "--grace", "infh"], "not a finite number"),
        (["gc", "{root}"], "--grace"),
        (["export", "{root}", "--run", RUN, "--out", "{tmp}/m.st", "--key", "ema"], "no tensors under 'ema.'"),
        (
            ["export", "{root}", "--run", RUN, "--out", "{tmp}/m.st", "--step", "15"],
            "run 'alpha' has no step 15 (steps: 10, 20)",
        ),
        (["export", "{root}", "--run", RUN, "--out", "{tmp}/no/dir/m.st"], "does not exist"),
        (["export", "{root}", "--run", RUN, "--out", "{tmp}/m.st", "--dtype", "int4"], "invalid choice"),
        (["export", "{root}", "--run", RUN, "--out", "{tmp}/m.st", "--max-shard-size", "big"], "not understood"),
        (["ls", ""], "ROOT is empty"),  # was the working directory
        (["ls", "{root}", "--run", RUN, "--select", ""], "selector '' is not one of"),  # listed everything
        (["verify", "{root}", "--run", RUN, "--step", "1_0"], "step '1_0' is not a step number"),  # was step 10
        (["export", "{root}", "--run", RUN, "--out", "{tmp}/m.st", "--step", "+10"], "is not a step number"),
        (["stats", "{root}", "--prices", "{tmp}/none.json"], "--prices {tmp}/none.json: cannot read it"),
        (["advise", "{root}", "--run", RUN, "--prices", "{tmp}"], "name a JSON file such as"),  # was [Errno 21]
        (
            ["stats", "{root}", "--prices", "{root}/../{{bad"],
            "it is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); name a "
            "JSON file such as",
        ),  # the JSON's fault, and where
        (["advise", "{root}", "--run", RUN, "--prices", "{tmp}/binary.json"], "--prices {tmp}/binary.json: "),  # was
        # a UnicodeDecodeError traceback
        (["stats", "{root}", "--prices", "{tmp}/binary.json"], "is not UTF-8 text; name a JSON file such as"),
        (["stats", "{root}", "--prices", "/dev/zero"], "/dev/zero: it holds more than 1048576"),  # read without end
        (["stats", "{root}", "--prices", "{tmp}/big.json"], "it holds more than 1048576 bytes"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_errors_are_one_line_and_exit_2(store, tmp_path, capsys, argv, expect):
    root, _, _ = store
    (tmp_path / "{bad").write_text("{bad")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe{}")
    (tmp_path / "big.json").write_bytes(b" " * (1 << 20) + b"{}")
    code, out, err = run_cli(capsys, *[a.format(root=root, tmp=tmp_path) for a in argv])
    assert code == 2
    assert err.startswith("ckptflow: error: ") and err.count("\n") == 1, err
    assert expect.format(tmp=tmp_path) in err and "Traceback" not in err and "[Errno" not in err
    assert not (Path(root) / "missing").exists()  # inspecting never creates a store


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
        # forked ranks share this process's imports: torch is imported once, not three times
        mp.start_processes(worker, args=(sys.argv[1], sys.argv[2]), nprocs=2, start_method="fork")
    """
)


def test_export_consolidates_two_shards(tmp_path, capsys):
    root = tmp_path / "store"
    root.mkdir()
    script = tmp_path / "save_sharded.py"
    script.write_text(SHARDED_SAVE)
    proc = subprocess.run(
        [sys.executable, str(script), str(root), str(tmp_path / "pg-init")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = read_manifest(open_store(str(root)), "sharded", 3)
    assert manifest.world_size == 2 and len(manifest.dcp.tensors["model.w"].shards) == 2
    out_file = tmp_path / "m.safetensors"
    code, _, err = run_cli(capsys, "export", root, "--run", "sharded", "--out", out_file)
    assert code == 0, err
    expected = load_file(str(tmp_path / "expected.safetensors"))
    loaded = load_file(str(out_file))
    assert loaded.keys() == {"w", "b"}
    assert torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["b"], expected["b"])
