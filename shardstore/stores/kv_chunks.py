"""Chunks as objects of a TensorStore kvstore: one PUT or GET per chunk, many in flight,
with TensorStore's retries (S3 and other object stores). Sharing a chunk with an
earlier checkpoint is a server-side copy, proven by the copy's ETag."""

from __future__ import annotations

__all__ = ["KvChunkStore"]

import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from shardstore.errors import CheckpointingException
from shardstore.stores.base import (
    ChunkMismatch,
    ChunkStore,
    CopiedObject,
    ExpectedBytes,
    StorageError,
    Store,
    check_range,
    fill_views,
)

# An ETag that can be an MD5 (a multipart upload's has a "-<parts>" suffix).
_MD5_HEX = re.compile(r"[0-9a-f]{32}")
# TensorStore's storage generation of an S3 object: a tag byte, then the quoted ETag.
_GENERATION_ETAG = re.compile(rb'"([^"]{1,128})"')

logger = logging.getLogger(__name__)


class KvChunkStore(ChunkStore):
    """Chunks as objects of a TensorStore kvstore (S3 and other object stores)."""

    # AWS's guidance sizes object-store requests at 8-16 MB: a request costs about as
    # much as moving 8 MiB more (``ChunkStore.request_bytes``).
    request_bytes = 8 << 20
    # TensorStore refuses (OUT_OF_RANGE) a byte range that ends past the object's end,
    # although S3 answers it, so ``get_into`` cannot ask for the byte that tells a
    # longer object without failing on every object that is not.
    tells_longer = False

    def __init__(self, store: Store, threads: int) -> None:
        import tensorstore as ts

        self.store, self.threads = store, threads
        self._etags_say_nothing = False  # a copy's ETag was no MD5 (``share_from``)
        self._etags_probed, self._probe_lock = False, threading.Lock()
        access = store.chunk_access()
        self._bucket = _bucket_of(access.kvstore or {})
        self._md5_etags = self._bucket in _MD5_ETAG_BUCKETS  # its ETags were shown to be MD5s
        try:
            self.kv = ts.KvStore.open(dict(access.kvstore or {}), context=ts.Context(dict(access.context))).result()
        except Exception as exc:
            raise CheckpointingException(f"Cannot open the object store of {store.describe()}: {exc}") from exc

    def describe(self, rel: str) -> str:
        return self.store.describe(rel)

    def put(self, rel: str, buffers: list[memoryview]) -> str | None:
        """One PUT; returns the ETag the store gave the object (TensorStore's storage
        generation of an S3 object is its quoted ETag), None where it names none."""
        written = self.kv.write(rel, b"".join(buffers)).result()
        return _etag_of(written.generation)

    def put_all(self, objects: dict[str, bytes]) -> None:
        """Writes every object with all requests in flight at once (up to the kvstore's
        request concurrency), then waits for them.

        Every write has ended before this returns or raises (an interrupt included), so
        a clean-up after a failure never races a write still in flight.

        Raises:
            StorageError: naming the first object whose write failed."""
        pending = {rel: self.kv.write(rel, data) for rel, data in objects.items()}
        failed: tuple[str, Exception] | None = None
        try:
            for rel, write in pending.items():
                try:
                    write.result()
                except Exception as exc:
                    failed = failed or (rel, exc)
        except BaseException:  # an interrupt: let the requests in flight end first
            for rel, write in pending.items():
                try:
                    write.result()
                except Exception as exc:  # the interrupt is what the caller hears; this is logged
                    logger.warning("Writing %s failed while an interrupt unwound the save: %s", self.describe(rel), exc)
            raise
        if failed is not None:
            rel, exc = failed
            raise StorageError(f"Cannot write {self.describe(rel)}: {exc}") from exc

    def get_into(self, rel: str, views: list[memoryview], tail: int) -> tuple[int, bytes] | None:
        """One ranged GET of the bytes the caller expects (the views and ``tail``, less
        the byte that would tell a longer object: ``tells_longer``), so an object
        replaced by a larger one is never downloaded whole; a longer object reads as
        its first bytes, which the caller checks.

        Raises:
            StorageError: naming the object: it is shorter than expected."""
        expected = max(0, sum(v.nbytes for v in views) + tail - 1)
        try:
            result = self.kv.read(rel, byte_range=slice(0, expected)).result()
        except ValueError as exc:  # TensorStore's OUT_OF_RANGE: the object is shorter
            raise StorageError(
                f"{self.describe(rel)} holds fewer than the {expected} bytes its commit record gives (truncated or "
                f"replaced since the commit); restore it from a copy of the checkpoint: {exc}"
            ) from exc
        return fill_views(views, memoryview(result.value), tail) if result.state == "value" else None

    def get_range_into(self, rel: str, offset: int, views: list[memoryview]) -> None:
        """One ranged GET (TensorStore's ``byte_range``) of exactly the views' bytes."""
        if not (total := sum(v.nbytes for v in views)):
            return
        if offset < 0:
            check_range(self.describe(rel), offset, total, 0)
        try:
            result = self.kv.read(rel, byte_range=slice(offset, offset + total)).result()
        except ValueError as exc:  # TensorStore's OUT_OF_RANGE: the object is shorter
            raise StorageError(f"Cannot read bytes [{offset}, {offset + total}) of {self.describe(rel)}: {exc}") from exc
        size = None if result.state != "value" else offset + len(result.value)
        check_range(self.describe(rel), offset, total, size)
        fill_views(views, memoryview(result.value), 0)

    def get_suffix(self, rel: str, nbytes: int) -> tuple[bytes, int] | None:
        """A suffix GET and the object's size (the store's ``size``: a HEAD on S3, which
        TensorStore does not report) at once; where the object is shorter than
        ``nbytes``, the suffix GET fails and one GET of the whole object follows. An
        object replaced between the two requests can pair one version's bytes with the
        other's size: the reader checks the bytes (a shard index's crc32c)."""
        suffix = self.kv.read(rel, byte_range=slice(-nbytes, None)) if nbytes else None
        size = self.store.size(rel)
        if size is None:
            return None
        if suffix is None:
            return b"", size
        if size < nbytes:
            suffix = self.kv.read(rel)
        try:
            result = suffix.result()
        except ValueError as exc:  # replaced by a shorter object since the HEAD
            raise StorageError(f"Cannot read the last {nbytes} bytes of {self.describe(rel)}: {exc}") from exc
        if result.state != "value":
            return None
        return result.value, size

    def share_from(self, source: ChunkStore, rel: str, held: ExpectedBytes) -> CopiedObject | None:
        """A server-side copy (the store's ``copy_from``), no bytes through this process,
        proven by the copy's ETag. S3 computes the ETag of an object written by one PUT
        (as TensorStore writes chunks, its payload signed with its SHA-256), without
        SSE-KMS or SSE-C, as the MD5 of the bytes it stores. So the copy holds
        ``held``'s bytes when its ETag is an MD5 and equals either

        - the ETag the earlier checkpoint's record bound to the object
          (``held.source_etag``): what S3 reported when it stored the bytes whose digest
          the record keeps, which ``held``'s bytes have; no byte is hashed here; or
        - the MD5 of ``held``'s bytes, computed here (records without ETags, or an
          object rewritten since with the same bytes).

        Until a copy showed this bucket's ETags to be the MD5 of the bytes (once per
        bucket and process, as a rule), a copy proven by the recorded ETag is compared
        with the MD5 too, so a store whose 32-hex-digit ETags name versions rather than
        bytes is found out before any copy is proven by a recorded ETag alone. Where the store reports
        another kind of ETag (encryption, a multipart upload) or none, nothing is
        proven without downloading the copy, which costs what writing it does: None,
        and the caller writes. An MD5 ETag that is neither (other bytes, or
        encryption) raises ChunkMismatch.

        The recorded ETag's proof trusts the earlier record to pair it with the digest
        of the bytes its store stored under it (records are sealed, and shardstore
        records only the ETag its store returned for those bytes); a record rewritten
        and resealed by hand can pair them otherwise, as it can name other crc32cs."""
        if not isinstance(source, KvChunkStore):
            return None
        if not self._etags_probed:  # the first copy tells what this store's ETags are; the others wait
            with self._probe_lock:
                if not self._etags_probed:
                    try:
                        return self._copy_or_remove(source, rel, held)
                    finally:
                        self._etags_probed = True
        return None if self._etags_say_nothing else self._copy_or_remove(source, rel, held)

    def _copy_or_remove(self, source: KvChunkStore, rel: str, held: ExpectedBytes) -> CopiedObject | None:
        """``_copy_proven``; a copy made but not proven is deleted, so that the caller's
        write of the bytes is a new object (``stores.s3_fenced`` writes only where none is)."""
        landed: list[str | None] = []
        try:
            copied = self._copy_proven(source, rel, held, landed)
        except ChunkMismatch:
            self._remove_copy(rel, landed[0])
            raise
        if copied is None and landed:
            self._remove_copy(rel, landed[0])
        return copied

    def _remove_copy(self, rel: str, etag: str | None) -> None:
        """Deletes the copy made at ``rel``: only where it is still that copy (its ETag),
        where the store deletes conditionally."""
        writes = self.store.conditional_writes()
        if etag is not None and writes is not None:
            writes.delete_if_version(rel, etag)
        else:
            self.store.delete(rel)

    def _copy_proven(
        self, source: KvChunkStore, rel: str, held: ExpectedBytes, landed: list[str | None]
    ) -> CopiedObject | None:
        """``share_from``'s copy and its proof (``landed`` gets the copy's ETag once a copy
        is made)."""
        recorded = held.source_etag if held.source_etag and _MD5_HEX.fullmatch(held.source_etag) else None
        if recorded is not None:
            copied, md5 = self.store.copy_from(source.store, rel), None
        else:
            copied, md5 = _while_hashing(held, lambda: self.store.copy_from(source.store, rel))
        if copied is None:
            return None
        landed.append(copied.etag)
        etag = copied.etag.lower() if copied.etag is not None else None
        if etag is None or not _MD5_HEX.fullmatch(etag):
            # a multipart ETag ("...-3"), an encrypted object's, or none: no later copy of
            # this save can be proven either, so none is tried (each would cost a request)
            self._etags_say_nothing = True
            return None
        if etag == recorded:
            # The recorded ETag's proof rests on this store's ETags being the MD5 of the
            # bytes: until a copy here showed it, this one is hashed too (once per
            # bucket and process, as a rule); ETags that only name versions end sharing.
            if self._md5_etags or self._shows_md5_etags(etag, held.md5_hex()):
                return CopiedObject(etag)
            self._etags_say_nothing = True
            return None
        if not self._shows_md5_etags(etag, md5 or held.md5_hex()):
            raise ChunkMismatch(
                f"{source.describe(rel)} does not hold the bytes being saved (its copy's ETag {etag} is not their "
                "MD5: changed or replaced since its commit)"
            )
        return CopiedObject(etag)

    def _shows_md5_etags(self, etag: str, md5: str) -> bool:
        """Whether a copy's ``etag`` is the ``md5`` of the bytes; if so, remembers for
        this bucket, for the life of the process, that its ETags are MD5s."""
        if etag != md5:
            return False
        self._md5_etags = True
        _MD5_ETAG_BUCKETS.add(self._bucket)
        return True


# The (driver, endpoint, bucket) of every object store whose copies' ETags a copy in
# this process showed to be the MD5 of their bytes (``KvChunkStore._shows_md5_etags``):
# a bucket's ETag scheme is its configuration (an encrypted object's ETag is refused
# apart, by the copy's reply), so later saves skip that one MD5.
_MD5_ETAG_BUCKETS: set[tuple] = set()


def _bucket_of(kvstore: dict) -> tuple:
    """What names a kvstore's bucket (not the path inside it, nor the credentials)."""
    return tuple(str(kvstore.get(k)) for k in ("driver", "endpoint", "bucket"))


T = TypeVar("T")
# A chunk at least this large has its MD5 computed on a thread of its own while the copy
# request is in flight (hashlib releases the GIL); a smaller one inline, where a thread
# would cost more than it hides.
MD5_BESIDE_BYTES = 2**20


def _while_hashing(held: ExpectedBytes, request: Callable[[], T]) -> tuple[T, str]:
    """``request()``'s result and ``held.md5_hex()``, the digest computed while the
    request waits on the network where the chunk is large enough for that to pay."""
    if held.nbytes < MD5_BESIDE_BYTES:
        return request(), held.md5_hex()
    with ThreadPoolExecutor(1) as beside:
        md5 = beside.submit(held.md5_hex)
        return request(), md5.result()


def _etag_of(generation: bytes) -> str | None:
    """The ETag, unquoted and lower-case, in a TensorStore storage generation of an S3
    object (``b'\\x00"<etag>"'``); None for any other generation."""
    found = _GENERATION_ETAG.search(generation)
    return found.group(1).decode("ascii", "replace").lower() if found else None
