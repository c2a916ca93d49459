"""``Registry.download`` streams: each model file goes from the store to its temporary file
piece by piece, hashed on the way, so a multi-GB weight file never sits whole in memory;
a file whose stored object is not the size its version records is refused before a byte
of it is read, one that does not hash to its record after; either way the directory is
left as it was, with no temporary file behind."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from ckptflow.errors import RegistryError
from ckptflow.interop.registry import ModelVersion, Registry, sha256_file
from ckptflow.store import open_store
from ckptflow.store.local import LocalStore
from support.child_env import child_env
from support.s3_faults import cut_first_get

MiB = 1 << 20
SCRIPT = Path(__file__).parents[1] / "support" / "download_rss.py"


def _random_file(path: Path, size: int, seed: int) -> None:
    """``size`` pseudo-random bytes, written a MiB at a time (never whole in memory)."""
    rng = random.Random(seed)
    with open(path, "wb") as f:
        for start in range(0, size, MiB):
            f.write(rng.randbytes(min(MiB, size - start)))


def _publish(reg: Registry, src: Path, sizes: dict[str, int]) -> ModelVersion:
    """Model ``m``, a new version of files of ``sizes`` bytes (made in ``src``)."""
    src.mkdir(exist_ok=True)
    for seed, (name, size) in enumerate(sorted(sizes.items())):
        _random_file(src / name, size, seed)
    files = reg.upload("m", src, sorted(sizes))
    return reg.register("m", run="r", step=1, manifest_digest="0" * 64, files=files)


def _served(directory: Path) -> dict[str, bytes]:
    """Every file in ``directory`` (temporary ones included) and its bytes."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _count_reads(store, key: str, monkeypatch) -> list[str]:
    """The reads of ``key``'s bytes the store makes from now on (GETs on S3)."""
    reads: list[str] = []
    if isinstance(store, LocalStore):
        for name in ("get", "get_bounded", "get_into", "scan", "read_head"):
            method = getattr(LocalStore, name)

            def counted(self, k, *args, _method=method, _name=name, **kwargs):
                if k == key:
                    reads.append(_name)
                return _method(self, k, *args, **kwargs)

            monkeypatch.setattr(LocalStore, name, counted)
    else:
        store.client.meta.events.register(
            "before-send.s3.GetObject", lambda request, **_: reads.append("GET") if key in request.url else None
        )
    return reads


# ---- what a download writes --------------------------------------------------------------------
def test_download_writes_every_file_exactly_and_replaces_what_was_served(store_url, tmp_path):
    """An empty file, one smaller than a piece, one of several pieces and a tail: each byte
    for byte, over a file the directory held before, and nothing else left there."""
    reg = Registry(open_store(store_url))
    sizes = {"README.md": 0, "config.json": 1234, "model.safetensors": 3 * MiB + 17}
    version = _publish(reg, tmp_path / "src", sizes)
    served = tmp_path / "served"
    served.mkdir()
    (served / "model.safetensors").write_bytes(b"the version served before")
    reg.download(version, served)
    assert _served(served) == {name: (tmp_path / "src" / name).read_bytes() for name in sizes}


def test_an_s3_download_cut_off_mid_file_is_retried_and_writes_the_exact_file(s3_store_url, tmp_path):
    """The GET of the weights times out 2.5 MiB in: the retried GET starts at the first byte
    again, the pieces already hashed and written are not hashed or written twice."""
    reg = Registry(open_store(s3_store_url))
    version = _publish(reg, tmp_path / "src", {"model.safetensors": 3 * MiB + 17})
    cut_first_get(reg.store, after=5 * MiB // 2)
    reg.download(version, tmp_path / "served")
    assert _served(tmp_path / "served") == {"model.safetensors": (tmp_path / "src" / "model.safetensors").read_bytes()}


# ---- what a download refuses -------------------------------------------------------------------
@pytest.mark.parametrize("change", ["record", "object"])
def test_a_file_whose_stored_size_is_not_its_recorded_size_is_refused_before_it_is_read(
    store_url, tmp_path, monkeypatch, change
):
    """The record says one size and the object holds another (the record edited, or the
    object replaced by other bytes under the same name): refused from the sizes alone,
    naming both, with nothing of it read and nothing in the directory changed."""
    reg = Registry(open_store(store_url))
    version = _publish(reg, tmp_path / "src", {"a.bin": 1000, "model.safetensors": 2 * MiB})
    key = reg.file_key("m", version.files["model.safetensors"]["sha256"])
    if change == "record":
        files = {**version.files, "model.safetensors": {**version.files["model.safetensors"], "size": 2 * MiB + 1}}
        version = ModelVersion(**{**version.to_json(), "files": files})
        recorded, held = 2 * MiB + 1, 2 * MiB
    else:
        reg.store.replace(key, b"x" * (3 * MiB))
        recorded, held = 2 * MiB, 3 * MiB
    served = tmp_path / "served"
    served.mkdir()
    (served / "model.safetensors").write_bytes(b"the version served before")
    reads = _count_reads(reg.store, key, monkeypatch)
    with pytest.raises(RegistryError) as err:
        reg.download(version, served)
    message = str(err.value)
    assert f"m v{version.version} file model.safetensors" in message
    assert f"records {recorded} bytes" in message and f"holds {held}" in message and key in message
    assert "nothing in" in message and "rebuild" in message
    assert reads == []
    assert _served(served) == {"model.safetensors": b"the version served before"}


@pytest.mark.parametrize("size", [-1, True, "12"])
def test_a_recorded_size_that_is_no_byte_count_is_refused(tmp_path, size):
    reg = Registry(open_store(str(tmp_path / "store")))
    version = _publish(reg, tmp_path / "src", {"model.safetensors": 10})
    files = {"model.safetensors": {**version.files["model.safetensors"], "size": size}}
    with pytest.raises(RegistryError, match=rf"m v1 file model.safetensors records size {size!r}, not a byte count"):
        reg.download(ModelVersion(**{**version.to_json(), "files": files}), tmp_path / "served")
    assert not (tmp_path / "served").exists() or _served(tmp_path / "served") == {}


def test_a_file_replaced_by_other_bytes_of_its_size_is_refused_and_changes_nothing(store_url, tmp_path):
    """The object under the last file's sha256 holds other bytes of the same size: found
    only by hashing it, after the files before it were written to temporary files; those
    are removed and the directory holds what it held."""
    reg = Registry(open_store(store_url))
    version = _publish(reg, tmp_path / "src", {"a.bin": 1000, "z.safetensors": 2 * MiB + 5})
    key = reg.file_key("m", version.files["z.safetensors"]["sha256"])
    reg.store.replace(key, bytes(2 * MiB + 5))
    served = tmp_path / "served"
    served.mkdir()
    (served / "a.bin").write_bytes(b"served before")
    with pytest.raises(RegistryError, match="m v1 file z.safetensors does not match its sha256") as err:
        reg.download(version, served)
    assert "nothing in" in str(err.value) and "rebuild" in str(err.value)
    assert _served(served) == {"a.bin": b"served before"}
    with pytest.raises(RegistryError, match="does not match its sha256"):
        reg.download(version, tmp_path / "new" / "served")
    assert not (tmp_path / "new").exists()  # a failed download leaves no directory it made


def test_a_file_deleted_from_the_registry_is_refused_naming_it_and_what_to_do(store_url, tmp_path):
    """A version's file deleted from the store: the store's bare "does not exist" named
    neither the version nor the file, nor that a rebuild brings it back."""
    reg = Registry(open_store(store_url))
    version = _publish(reg, tmp_path / "src", {"a.bin": 1000, "model.safetensors": 2000})
    key = reg.file_key("m", version.files["model.safetensors"]["sha256"])
    reg.store.delete(key)
    served = tmp_path / "served"
    served.mkdir()
    (served / "a.bin").write_bytes(b"served before")
    with pytest.raises(RegistryError, match="m v1 file model.safetensors is missing") as err:
        reg.download(version, served)
    assert key in str(err.value) and "nothing in" in str(err.value) and "rebuild" in str(err.value)
    assert _served(served) == {"a.bin": b"served before"}


def test_a_file_deleted_after_its_size_was_checked_is_refused_the_same_way(store_url, tmp_path, monkeypatch):
    """Deleted between the size check and the read: the store's bare "does not exist"."""
    reg = Registry(open_store(store_url))
    version = _publish(reg, tmp_path / "src", {"model.safetensors": 2000})
    key = reg.file_key("m", version.files["model.safetensors"]["sha256"])
    checked = reg.store.stat

    def checked_then_deleted(k):
        info = checked(k)
        reg.store.delete(k)
        return info

    monkeypatch.setattr(reg.store, "stat", checked_then_deleted)
    with pytest.raises(RegistryError, match="m v1 file model.safetensors is missing") as err:
        reg.download(version, tmp_path / "served")
    assert key in str(err.value) and "rebuild" in str(err.value)
    assert not (tmp_path / "served").exists()


# ---- memory --------------------------------------------------------------------------------------
def _download_rss(url: str, size: int, tmp_path: Path) -> dict:
    """Publish one file of ``size`` bytes at ``url``, download it in a process of its own:
    its RSS growth and duration, once the file is checked exact."""
    reg = Registry(open_store(url))
    version = _publish(reg, tmp_path / "src", {"model.safetensors": size})
    (tmp_path / "src" / "model.safetensors").unlink()
    out = tmp_path / "served"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), url, "m", str(version.version), str(out)],
        env=child_env(SCRIPT.parents[2], SCRIPT.parents[1]),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.splitlines()[-1])
    assert os.listdir(out) == ["model.safetensors"]
    assert sha256_file(out / "model.safetensors") == version.files["model.safetensors"]["sha256"]
    return {"growth_mib": measured["peak_mib"] - measured["before_mib"], "seconds": measured["seconds"]}


needs_proc = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc for peak RSS")


@needs_proc
def test_a_local_download_of_256_mib_holds_far_less_than_the_file(tmp_path):
    """Read whole, the file alone raised the peak by its size (256 MiB)."""
    measured = _download_rss(str(tmp_path / "store"), 256 * MiB, tmp_path)
    assert measured["growth_mib"] < 64, measured


@needs_proc
def test_an_s3_download_of_128_mib_holds_far_less_than_the_file(s3_store_url, tmp_path):
    """Read whole (the GET body as one bytes), the peak rose by the file's size (128 MiB)."""
    measured = _download_rss(s3_store_url, 128 * MiB, tmp_path)
    assert measured["growth_mib"] < 64, measured
