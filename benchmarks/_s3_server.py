"""moto's S3 server, run as a script by the scale harness, with listings that cost what
a real bucket's cost.

moto answers every ListObjectsV2 page by sorting every key under the prefix: a page of a
30,000-key bucket costs it about half a second, so a 20-page listing measured the test
server (quadratically), not the client. Here a prefix's sorted listing is kept until the
next write or delete in the bucket and a page is found by bisection; the answers are
moto's own (same keys, same order, same tokens).

Run: ``python benchmarks/_s3_server.py PORT``
"""

from __future__ import annotations

import bisect
import sys
from typing import Any

from moto.s3.models import FakeKey, S3Backend
from moto.server import main

_cache: dict[tuple, tuple[int, list, list[str]]] = {}
_generation = [0]


def _bumping(method: Any) -> Any:
    def wrapper(self: S3Backend, *args: Any, **kwargs: Any) -> Any:
        _generation[0] += 1
        return method(self, *args, **kwargs)

    return wrapper


def _name(item: Any) -> str:
    return item.name if isinstance(item, FakeKey) else item


def list_objects_v2(self: S3Backend, bucket, prefix, delimiter, continuation_token, start_after, max_keys):
    key = (bucket.name, prefix, delimiter)
    cached = _cache.get(key)
    if cached is None or cached[0] != _generation[0]:
        keys, folders, _, _ = self.list_objects(bucket, prefix, delimiter, marker=None, max_keys=None)
        items = sorted([*keys, *folders], key=_name)
        cached = _cache[key] = (_generation[0], items, [_name(i) for i in items])
    _, items, names = cached
    start = 0
    if continuation_token or start_after:
        limit = self._pagination_tokens.get(continuation_token) if continuation_token else start_after
        start = bisect.bisect_right(names, limit)
    return self._truncate_result(items[start:][: max_keys + 1] if max_keys else items[start:], max_keys)


S3Backend.put_object = _bumping(S3Backend.put_object)  # type: ignore[method-assign]
S3Backend.delete_object = _bumping(S3Backend.delete_object)  # type: ignore[method-assign]
S3Backend.list_objects_v2 = list_objects_v2  # type: ignore[method-assign]

if __name__ == "__main__":
    main(["-H", "127.0.0.1", "-p", sys.argv[1]])
