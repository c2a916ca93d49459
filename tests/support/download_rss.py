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

from peak_rss import reset_peak, status_mib  # this directory: run as a script

from ckptflow.interop.registry import Registry
from ckptflow.store import open_store


def main(url: str, model: str, version: str, directory: str) -> None:
    registry = Registry(open_store(url))
    record = registry.get(model, int(version))
    assert registry.missing_files(record) == []  # the client and its connections warmed up
    before = status_mib("VmRSS")
    reset_peak()
    started = time.perf_counter()
    registry.download(record, directory)
    seconds = time.perf_counter() - started
    print(json.dumps({"before_mib": before, "peak_mib": status_mib("VmHWM"), "seconds": seconds}))


if __name__ == "__main__":
    main(*sys.argv[1:])
