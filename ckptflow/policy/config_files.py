"""A small file a user names for its settings (a price list: ``stats --prices`` and
``CKPTFLOW_PRICES``; a retention policy: ``CKPTFLOW_RETENTION``), read with bounds.

The Dagster variables are read when the code location loads, so a read that never ends
would hang the load with nothing said: a file that never ends (``/dev/zero``) stops at
``max_bytes``, and a pipe (``/dev/stdin``, ``<(...)``, a FIFO) that no process writes, or
whose writer never closes it, stops after ``PIPE_WAIT_S``.
"""

from __future__ import annotations

import os
import select
import time

PIPE_WAIT_S = 30.0  # long enough for a command that fetches the file (``<(aws s3 cp ... -)``)


def read_config_file(path: str, *, max_bytes: int) -> bytes:
    """The bytes of ``path``, any file that reads; ``OSError`` if it cannot be opened or
    read, ``ValueError`` saying why if it holds more than ``max_bytes`` or is not read to
    its end within ``PIPE_WAIT_S`` (opened without blocking: a FIFO with no writer would
    block ``open`` itself)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + PIPE_WAIT_S
        blocks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):  # a regular file is always ready
                raise ValueError(
                    f"it was not read to its end within {PIPE_WAIT_S:g} s (a pipe that no process writes, or "
                    "whose writer never closes it)"
                )
            try:
                block = os.read(fd, max_bytes + 1 - size)
            except BlockingIOError:  # a pipe whose writer has written nothing more yet
                continue
            if not block:
                return b"".join(blocks)
            blocks.append(block)
            size += len(block)
    finally:
        os.close(fd)
    raise ValueError(f"it holds more than {max_bytes} bytes; refused")
