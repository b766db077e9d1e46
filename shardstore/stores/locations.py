"""Which store a checkpoint path names: the registry of URL schemes.

A backend registers its scheme here, once, with the factory that builds its store from
the URL and the caller's options; a path without a scheme is a local directory. This is
the one module that knows every backend, so that no backend module needs another.
"""

from __future__ import annotations

__all__ = ["BACKENDS", "StoreFactory", "open_location", "open_store"]

import os
from collections.abc import Callable
from typing import Any

from shardstore.stores.base import Location, StorageError, Store
from shardstore.stores.local import LocalStore
from shardstore.stores.memory import MemoryStore
from shardstore.stores.s3 import S3Store

StoreFactory = Callable[..., Store]

# scheme (the text before "://") -> factory(url, **options)
BACKENDS: dict[str, StoreFactory] = {
    "s3": S3Store,
    "memory": MemoryStore,
}


def open_store(target: str | bytes | os.PathLike, **options: Any) -> Store:
    """The store a path or URL names.

    Args:
        target: a local path, or ``<scheme>://...`` for a registered scheme
            (``s3://bucket/prefix``, ``memory://name/prefix``), as a str: a
            ``pathlib.Path`` of a URL (``s3:/bucket/prefix``) is refused
        options: passed to the store (``fsync=False`` for local paths,
            ``options=S3Options(...)`` for S3)
    """
    text = os.fsdecode(target)  # a bytes path as the os functions take it
    if "://" not in text:
        _refuse_collapsed_url(text)
        return LocalStore(text, **options)
    scheme = text.split("://", 1)[0]
    factory = BACKENDS.get(scheme)
    if factory is None:
        known = ", ".join(f"{s}://" for s in sorted(BACKENDS))
        raise StorageError(
            f"Unsupported checkpoint location scheme {scheme!r} in {text!r}: use a local path or one of {known}"
        )
    return factory(text, **options)


def _refuse_collapsed_url(path: str) -> None:
    """Refuses a local path that is a registered scheme's URL with its ``//`` collapsed
    to ``/``, as ``pathlib.Path("s3://bucket/prefix")`` makes it (``s3:/bucket/prefix``):
    taken as a path, the save would go to a directory ``s3:`` on the local disk."""
    scheme, collapsed, rest = path.partition(":/")
    if collapsed and scheme in BACKENDS:
        url = f"{scheme}://{rest.lstrip('/')}"
        raise StorageError(
            f"{path!r} is not a local path but the URL {url} with its '//' collapsed (pathlib.Path does that): "
            f"pass {url!r} as a str, not a Path"
        )


def open_location(target: str | bytes | os.PathLike | Location, **options: Any) -> Location:
    """The Location for a checkpoint directory given as a path, URL or Location
    (returned as it is)."""
    if isinstance(target, Location):
        return target
    return Location(open_store(target, **options))
