"""A registry download in a process of its own, so its peak RSS is its own (VmHWM).

``python download_rss.py URL MODEL VERSION DIRECTORY`` opens the store at URL, downloads
MODEL's version VERSION into DIRECTORY and prints JSON: the RSS before the download, the
peak during it (MiB) and its duration. The store's client and the version record are read
before the peak is reset, so what is measured is the download alone.
"""

from __future__ import annotations

import json
import sys
import time

from ckptflow.interop.registry import Registry
from ckptflow.store import open_store


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(url: str, model: str, version: str, directory: str) -> None:
    registry = Registry(open_store(url))
    record = registry.get(model, int(version))
    assert registry.missing_files(record) == []  # the client and its connections warmed up
    before = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
        f.write("5")
    started = time.perf_counter()
    registry.download(record, directory)
    seconds = time.perf_counter() - started
    print(json.dumps({"before_mib": before, "peak_mib": _status_mib("VmHWM"), "seconds": seconds}))


if __name__ == "__main__":
    main(*sys.argv[1:])
