"""Conditional writes: the compare-and-swap an object store offers where a file system
offers ``rename`` and ``flock``.

An in-place save (``format.commit.InPlace``) claims its prefix by writing its claim into
the root ``zarr.json`` only where nothing (or what it may replace) is, keeps the claim by
rewriting it only while it still holds the version it wrote last, and commits by
replacing it with the commit record on that same condition (``format.claims``). A store that can do this atomically (S3 since 2024 with
``If-None-Match: *`` and ``If-Match``, MinIO, moto; ``memory://`` under a lock) offers a
``ConditionalWrites`` through ``Store.conditional_writes``.

A conditional write whose answer was lost and that botocore sent again is refused the
second time (the first one landed): ``put_if_absent`` and ``put_if_version`` then read
the object back, and where it holds exactly the bytes written, the write is done. So
every value written here must be unique to its writer and moment (a save id and a
counter), or that proof proves nothing.
"""

from __future__ import annotations

__all__ = ["ConditionalWrites", "PreconditionFailed", "VersionedObject"]

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionedObject:
    """An object as one read found it.

    Attributes:
        data: its bytes.
        version: the store's name for exactly this write of it (an S3 ETag).
        age_s: seconds since it was written, by the store's own clock (no host's clock
            is compared with another's).
    """

    data: bytes
    version: str
    age_s: float


class PreconditionFailed(Exception):
    """A conditional write the store refused: the key exists (``put_if_absent``) or holds
    another version (``put_if_version``). Raised by ``ConditionalWrites._put`` only."""


class ConditionalWrites(ABC):
    """A store's atomic conditional writes of whole objects (keys as ``Store``'s).

    Attributes:
        lease_s: how long a save's claim on a prefix holds without being renewed: a
            marker not rewritten for that long is a dead save's (``format.claims``). 0
            where the store itself keeps saves apart for as long as they run
            (``Store.claim_for_save`` of ``memory://``): any marker found is then dead.
    """

    lease_s: float = 0.0

    @abstractmethod
    def _put(self, key: str, data: bytes, version: str | None) -> str:
        """Writes ``data`` at ``key`` where it holds ``version`` (None: where it holds
        nothing) and returns the new version; raises ``PreconditionFailed`` otherwise."""

    @abstractmethod
    def get_versioned(self, key: str, max_bytes: int) -> VersionedObject | None:
        """``key`` as it is now (None: there is none), its bytes cut after ``max_bytes``
        + 1, so that a longer object is told by its length."""

    def version_of(self, key: str) -> str | None:
        """The version ``key`` holds now (None: none); a store that can tell it without
        the bytes (a HEAD) overrides this."""
        found = self.get_versioned(key, max_bytes=0)
        return found.version if found is not None else None

    def delete_if_version(self, key: str, version: str) -> bool:
        """Deletes ``key`` where it holds ``version``; False where it holds another one
        (or none). This default reads, then deletes: a store that can delete
        conditionally (S3's ``If-Match`` on DELETE) overrides it."""
        if self.version_of(key) != version:
            return False
        self._delete(key)
        return True

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Deletes ``key`` (no error where it holds nothing)."""

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        """Writes ``data`` where ``key`` holds nothing: its version, or None where the key
        holds another object (``data`` itself there: done, by an earlier attempt)."""
        return self._put_or_settle(key, data, None)

    def put_if_version(self, key: str, data: bytes, version: str) -> str | None:
        """Writes ``data`` where ``key`` holds ``version``: the new version, or None where
        it holds another one or none."""
        return self._put_or_settle(key, data, version)

    def _put_or_settle(self, key: str, data: bytes, version: str | None) -> str | None:
        try:
            return self._put(key, data, version)
        except PreconditionFailed:
            found = self.get_versioned(key, max_bytes=len(data))
            return found.version if found is not None and found.data == data else None
        except OSError as exc:  # every answer lost: the write may have landed all the same
            found = self.get_versioned(key, max_bytes=len(data))
            if found is None or found.data != data:
                raise
            logger.warning("%s; the object holds the bytes written all the same: done", exc)
            return found.version
