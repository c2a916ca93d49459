"""Backends by URL scheme: ``open_store(url)`` picks one."""

from __future__ import annotations

import os
from urllib.parse import parse_qs, unquote, urlparse

from ckptflow.store.base import ObjectInfo, Store, validate_key
from ckptflow.store.local import LocalStore, resolved_root

# S3Store: ckptflow.store.s3
__all__ = ["ObjectInfo", "Store", "LocalStore", "local_root", "open_store", "validate_key"]


def open_store(url: str | os.PathLike[str] | Store, *, create: bool = True) -> Store:
    """Open a store from a plain path, a ``file://`` URL, ``s3://bucket/prefix`` (optionally
    ``?endpoint=http://host:port`` for an S3-compatible store), or return a ``Store`` as is.

    The one place a URL becomes a backend. ``create=False`` (commands that only inspect)
    refuses a local root that does not exist instead of creating an empty store.
    """
    if isinstance(url, Store):
        return url
    url = os.fspath(url)
    path = _local_path(url)
    if path is not None:
        return LocalStore(path, create=create)
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        from ckptflow.store.s3 import S3Store  # boto3 is imported only for S3 stores

        query = parse_qs(parsed.query)
        unknown = set(query) - {"endpoint", "region"}
        if not parsed.netloc or unknown:
            raise ValueError(f"S3 URL {url!r} must look like s3://bucket/prefix[?endpoint=URL&region=R]")
        return S3Store(
            parsed.netloc,
            unquote(parsed.path).strip("/"),
            endpoint_url=query.get("endpoint", [None])[0],
            region=query.get("region", [None])[0],
        )
    raise ValueError(
        f"no store backend for scheme {parsed.scheme!r} in {url!r}; supported: plain paths, file:// and s3:// URLs"
    )


def local_root(url: str) -> str | None:
    """The directory ``open_store(url)`` would open as a local store, resolved as the store
    resolves it (``resolved_root``); None for an object store or a URL no store opens."""
    try:
        path = _local_path(url)
    except ValueError:
        return None
    return None if path is None else resolved_root(path)


def _local_path(url: str) -> str | None:
    """The path of a plain path or ``file://`` URL as given; None for another scheme."""
    parsed = urlparse(url)
    if not (parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and url[1:3] == ":\\")):
        return None
    if parsed.scheme != "file":
        return url
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"file URL {url!r} names host {parsed.netloc!r}; use file:///abs/path")
    return unquote(parsed.path)
