"""A small file a user names for its settings (a price list: ``stats --prices`` and
``CKPTFLOW_PRICES``; a retention policy: ``CKPTFLOW_RETENTION``), read with bounds.

The Dagster variables are read when the code location loads, so a read that never ends
would hang the load with nothing said: a file that never ends (``/dev/zero``) stops at
``max_bytes``, and a pipe (``/dev/stdin``, ``<(...)``, a FIFO) that no process writes, or
whose writer never closes it, stops after ``PIPE_WAIT_S``. Each is a JSON document
(``read_config_json``), whose every problem is said the same way whichever file it is.
"""

from __future__ import annotations

import json
import os
import select
import time
from typing import Any

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


def read_config_json(path: str, *, max_bytes: int) -> Any:
    """The JSON document in ``path`` (``read_config_file``'s bounds; UTF-8, which RFC 8259
    requires of JSON exchanged); ``ValueError`` saying what is wrong, for the caller to say
    where and what to do: it cannot be read, is past a bound, holds a byte that is not
    UTF-8 (named), is not JSON, or nests deeper than ``json`` recurses (a file of 100,000
    '[' raised ``RecursionError`` from inside ``json``)."""
    try:
        return json.loads(read_config_file(path, max_bytes=max_bytes).decode("utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"byte {e.start} is not UTF-8 text") from None
    except json.JSONDecodeError as e:  # json's own words name no file kind (an empty file: 'Expecting value')
        raise ValueError(f"it is not JSON ({e})") from None
    except RecursionError:
        raise ValueError("its JSON is nested too deeply") from None
