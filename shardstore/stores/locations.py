"""Which Location a checkpoint path names: a local directory or ``s3://bucket/prefix``.

The one place that knows every kind of location (``storage.LocalLocation``,
``s3.S3Location``), so that neither of those modules needs the other.
"""

from __future__ import annotations

import os
from typing import Any

from shardstore.stores.base import LocalLocation, Location, StorageError
from shardstore.stores.s3 import S3Location


def open_location(target: str | os.PathLike | Location, **options: Any) -> Location:
    """The Location for a checkpoint directory given as a path, URL or Location.

    Args:
        target: a local path, ``s3://bucket/prefix``, or a Location (returned as is)
        options: passed to the Location (``fsync=False`` for local paths,
            ``options=S3Options(...)`` for S3)
    """
    if isinstance(target, Location):
        return target
    text = os.fspath(target)
    if text.startswith("s3://"):
        return S3Location(text, **options)
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise StorageError(
            f"Unsupported checkpoint location scheme {scheme!r} in {text!r}: use a local path or s3://bucket/prefix"
        )
    return LocalLocation(text, **options)
