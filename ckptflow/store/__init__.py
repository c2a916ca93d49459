"""Backends by URL scheme: ``open_store(url)`` picks one."""

from __future__ import annotations

from urllib.parse import unquote, urlparse

from ckptflow.store.base import ObjectInfo, Store, validate_key
from ckptflow.store.local import LocalStore

__all__ = ["ObjectInfo", "Store", "LocalStore", "open_store", "validate_key"]


def open_store(url: "str | Store") -> Store:
    """Open a store from a plain path, a ``file://`` URL, or return a ``Store`` as is."""
    if isinstance(url, Store):
        return url
    url = str(url)
    parsed = urlparse(url)
    if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and url[1:3] == ":\\"):
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"file URL {url!r} names host {parsed.netloc!r}; use file:///abs/path")
            return LocalStore(unquote(parsed.path))
        return LocalStore(url)
    raise ValueError(
        f"no store backend for scheme {parsed.scheme!r} in {url!r}; "
        "supported: plain paths and file:// URLs"
    )
