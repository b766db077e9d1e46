"""The store interface: bytes in and out by key, and what a backend can do.

A backend (``local``, ``s3``, ``memory``) implements ``Store``: a bytes-only key-value
interface in the spirit of zarr-python's ``zarr.abc.store.Store`` (get with a size cap,
put, put_atomic, delete, delete_prefix, list, list_dir, exists), plus data saying what
it can do (``Capabilities``) and how chunk I/O reaches its bytes (``ChunkAccess``).
Callers ask those instead of asking which backend it is.

Publishing a save is its own small interface (``DirectoryPublishing``): a store that can
rename directories atomically (local and shared POSIX file systems) implements it, and
a save then writes into a staging directory beside its target, which one rename (or an
atomic exchange) makes visible; ``format.commit`` decides when, under
``parent_locked``. Any other store (object stores, memory) is published in place: the
commit record, one atomic put, is written last.

The rest of shardstore holds a ``Location``: a checkpoint's root on one store, with the
names callers use. A location that changes a few things (a committed checkpoint whose
reads are checked, a pending save that names its target in errors) subclasses it and
shares the store, so it overrides only what it changes and forwards nothing by hand.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_IO_THREADS", "STREAM_BLOCK_BYTES", "Capabilities", "ChunkAccess", "ChunkMismatch", "ChunkStore",
    "CopiedObject", "DirectoryPublishing", "ExpectedBytes", "Location", "NameLimits", "OBJECT_VERSION_TEXT",
    "REFUSABLE_TEXTS", "Fold", "RangeReader",
    "StorageError", "Store", "atomic_temp_name", "atomic_temp_of", "check_range", "fill_views", "fold_landed",
    "kvstore_spec", "run_parallel", "usable_cpus",
]

import contextlib
import functools
import os
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shardstore.errors import CheckpointingException
from shardstore.stores.conditional import ConditionalWrites

# Threads for batches of small-object writes; they release the GIL in write().
SMALL_FILE_WRITERS = 8
# Bytes in which a chunk is checksummed and written when its store writes as it goes
# (``ChunkStore.put``): each block is hashed and copied out while in cache.
STREAM_BLOCK_BYTES = 1 << 20
# Threads doing chunk I/O per rank; more did not help on local disks (a cold load of
# 5,000 small chunks on 2 cores: 0.9 s at 8 threads, 1.0-1.3 s at 32 and 64).
DEFAULT_IO_THREADS = 8


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a job scheduler or a
    container's cpuset narrows), at least 1; ``os.cpu_count()`` counts the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform (macOS, Windows)
        return max(1, os.cpu_count() or 1)


# The temporary file a store's ``put_atomic`` writes beside the key and then renames onto
# it (``.<name>.<32 hex digits>.tmp``): a process killed in between leaves it there.
_ATOMIC_TEMP = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{32}\.tmp")


def atomic_temp_name(name: str) -> str:
    """A fresh name for ``put_atomic``'s temporary file of ``name``, in its directory."""
    return f".{name}.{uuid.uuid4().hex}.tmp"


def atomic_temp_of(entry: str) -> str | None:
    """The name whose ``put_atomic`` temporary file ``entry`` is (``atomic_temp_name``),
    or None where it is none."""
    match = _ATOMIC_TEMP.fullmatch(entry)
    return match["name"] if match else None


class StorageError(CheckpointingException, OSError):
    """A storage operation failed; the message names the location and the object.

    A CheckpointingException (what callers catch) and an OSError (what it is)."""


@dataclass(frozen=True)
class CopiedObject:
    """What a server-side copy made (``Store.copy_from``), or a chunk shared with an
    earlier checkpoint (``ChunkStore.share_from``), as the store reported it.

    Attributes:
        etag: the new object's entity tag, without quotes, or None where the store
            reports none. On S3 the ETag of an object written by one PUT without
            SSE-KMS or SSE-C is the MD5 of its bytes; otherwise it names the object but
            says nothing of its bytes.
    """

    etag: str | None = None


@dataclass(frozen=True)
class NameLimits:
    """The longest names a location stores, in bytes of UTF-8 (None: no limit): a save
    checks its keys against them before it writes anything (``format.check_key``).

    Attributes:
        max_name_bytes: one ``/``-separated segment of a relative path (a file system's
            NAME_MAX).
        max_path_bytes: a whole relative path under the location (what PATH_MAX or an
            object store's key limit leaves after the location's own path or prefix).
        path_limit: what bounds ``max_path_bytes``, for error messages.
        refused_texts: of a location, the texts no path may hold (S3: ``?versionId=``,
            which s3fs reads as an object version), each with why; of a layout's needs
            (``planning.checks.name_lengths_needed``), those of ``REFUSABLE_TEXTS`` its
            paths hold (the why left empty).
    """

    max_name_bytes: int | None = None
    max_path_bytes: int | None = None
    path_limit: str = ""
    refused_texts: tuple[tuple[str, str], ...] = ()


OBJECT_VERSION_TEXT = "?versionId="
"""s3fs cuts a path at this text and reads the rest as an object version, whatever the
file system's settings (``S3FileSystem.split_path``)."""

REFUSABLE_TEXTS = (OBJECT_VERSION_TEXT,)
"""Every text a store's ``NameLimits.refused_texts`` may name."""


@dataclass(frozen=True)
class Capabilities:
    """What a store can do; callers ask these instead of which backend it is.

    Attributes:
        is_local_filesystem: keys are files under a POSIX directory (``Store.local_path``
            names them), which other tools' checkpoints and file conversions need.
        supports_rename: whole directories move atomically (``Store.publishing``), so a
            save stages apart from its target and publishes by rename.
        supports_fsync: writes are durable only after ``make_durable``.
        max_object_bytes: the largest object one put stores (None: no limit).
        shared_across_processes: every process that opens the same location sees the
            same objects (a file system, an object store), so the ranks of a save can
            write one checkpoint together. A store private to its process (``memory``)
            takes single-process saves only (``format.commit.check_shared``). A backend
            opts in: one that does not say is taken as private.
    """

    is_local_filesystem: bool = False
    supports_rename: bool = False
    supports_fsync: bool = False
    max_object_bytes: int | None = None
    shared_across_processes: bool = False


@dataclass(frozen=True)
class ChunkAccess:
    """How TensorStore (``kvstore_spec``) and a store's own chunk I/O
    (``Store.chunk_store``) reach its bytes, as data.

    Attributes:
        local_root: chunks are files under this directory, written and read in place
            with ``writev``/``readv`` (the fastest path).
        kvstore: a TensorStore kvstore spec of the store's root, for backends TensorStore
            reaches itself (many requests in flight, its own retries).
        context: TensorStore context resources suited to this storage.
    With neither ``local_root`` nor ``kvstore``, chunks go through the store's own
    ``get``/``put`` (backends TensorStore cannot see, such as fsspec's memory).
    """

    local_root: Path | None = None
    kvstore: Mapping[str, Any] | None = None
    context: Mapping[str, Any] = field(default_factory=dict)


class Store(ABC):
    """A backend: objects by ``/``-separated key under one root, bytes only.

    Keys are relative to the store's root (``""`` is the root itself where a prefix or
    directory is meant). A missing key is not an error for ``get`` (None), ``delete``
    and ``delete_prefix`` (nothing to do) or the listings (empty).
    """

    capabilities: Capabilities = Capabilities()

    @abstractmethod
    def describe(self, key: str = "") -> str:
        """A human-readable address of ``key`` for error messages."""

    @abstractmethod
    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """The object's bytes, or None if it does not exist.

        ``max_bytes``: refuse (StorageError) an object larger than this: records are
        read through a bound, so a hostile one cannot make the reader allocate without
        limit.
        """

    def size(self, key: str) -> int | None:
        """The object's size in bytes, or None if it does not exist; by default by
        reading it (a backend with a cheaper way, such as a HEAD request, says so)."""
        data = self.get(key)
        return None if data is None else len(data)

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """``list(prefix)``'s keys, each with its size in bytes; by default one ``size``
        per key (an object store's listing names them at once)."""
        return {key: size for key in self.list(prefix) if (size := self.size(key)) is not None}

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Stores one object (durable only after ``make_durable``)."""

    @abstractmethod
    def put_atomic(self, key: str, data: bytes) -> None:
        """Stores one object so that readers see the old content or all of the new,
        never part of it, durably."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Removes one object if it exists."""

    @abstractmethod
    def delete_prefix(self, prefix: str = "", keep: Collection[str] = ()) -> None:
        """Removes every object under the directory ``prefix`` (the key itself when it
        names an object; everything for ``""``) and nothing outside it. ``keep``: names
        of objects directly under ``prefix`` left in place (an in-place save's marker,
        removed last so that what an interrupted removal leaves is still marked)."""

    def delete_many(self, keys: list[str]) -> None:
        """Deletes these exact keys (missing ones are no error), in few requests."""
        run_parallel(self.delete, keys)

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Every object key under the directory ``prefix``, relative to the root, sorted
        (locally: every entry that is not a directory, links and special files included,
        none followed)."""

    @abstractmethod
    def list_dir(self, prefix: str = "") -> list[str]:
        """The names directly under the directory ``prefix`` (objects and directories),
        sorted."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` names an object (or, on a file system, a directory)."""

    @abstractmethod
    def child(self, name: str) -> Store:
        """The store of the directory ``name`` under this one (same options)."""

    def enclosing(self) -> list[Store]:
        """The stores of the directories (prefixes) that hold this one, nearest first,
        up to the file system's or the bucket's root: where a save looks for a
        checkpoint it would lie inside. None known by default."""
        return []

    @abstractmethod
    def chunk_access(self) -> ChunkAccess:
        """How TensorStore and the chunk I/O reach this store's bytes."""

    def chunk_store(self, io_concurrency: int, local_threads: int = DEFAULT_IO_THREADS) -> ChunkStore:
        """The chunk I/O of this store (``ChunkStore``), running ``io_concurrency``
        operations at once where they go over a network, ``local_threads`` where they
        are this machine's: by default the store's own get and put."""
        return StoreChunkStore(self, min(io_concurrency, local_threads))

    def copy_from(self, source: Store, key: str) -> CopiedObject | None:
        """Copies the object ``key`` of ``source`` to ``key`` here without moving its
        bytes through this process (a server-side copy), where both stores are on the
        same storage service; returns what the store says of the copy. None where this
        store cannot (the caller then writes the bytes itself) or the source object does
        not exist. Never changes the source. The copy holds whatever the source holds
        at that moment: a caller that needs particular bytes checks the result."""
        return None

    def put_many(self, objects: dict[str, bytes]) -> None:
        """Stores many small objects concurrently."""
        run_parallel(lambda item: self.put(*item), list(objects.items()))

    def put_new(self, objects: dict[str, bytes]) -> None:
        """Stores objects of an in-place save, each new in the prefix it claimed: where
        the store fences writers that lost their claim (S3), only where none is."""
        self.put_many(objects)

    def make_directories(self, prefixes: Iterable[str]) -> None:
        """Makes the directories ``prefixes`` name, before many threads write files
        into them, where the store has directories (nothing to do by default: objects
        need none)."""
        return None

    @property
    def name_limits(self) -> NameLimits:
        """The longest names and keys this store takes (none known here)."""
        return NameLimits()

    def claim_for_save(self, save_id: str) -> Callable[[], None]:
        """Claims this store's root for the save ``save_id`` of this process until the
        returned function is called; raises StorageError while another save holds it (or
        a root inside it, or one it is inside).

        Only a store whose saves nothing else keeps apart needs a claim (``memory``: two
        threads saving into one prefix would each remove the other's files). Elsewhere
        saves stay apart by their markers, staging locks and the commit's
        compare-and-swap (``format.commit``), so nothing is claimed by default."""
        return _nothing_to_release

    def prepare(self) -> None:
        """Makes the store ready to receive objects (creates its directory, checks that
        its bucket exists). Nothing to do by default."""
        return None

    def missing_container(self) -> str | None:
        """What holds the store's objects and does not exist, said for an error (an
        object store's bucket), or None: it exists, cannot be asked, or the store has
        none (a directory that does not exist is an empty one). Changes nothing."""
        return None

    def begin_writes(self) -> None:
        """Called before this process writes its first byte of a save (local disks
        open the descriptor that ``make_durable`` syncs through, so write-back errors
        from then on are reported). Nothing to do by default."""
        return None

    def end_writes(self) -> None:
        """Releases what ``begin_writes`` holds (after a failed save; ``make_durable``
        releases it on success)."""
        return None

    def make_durable(self) -> None:
        """Blocks until everything this process wrote is on stable storage (nothing to
        do where a put is durable once it returned)."""
        return None

    def local_path(self, key: str = "") -> Path | None:
        """The POSIX path of ``key`` where ``capabilities.is_local_filesystem``, else None."""
        return None

    def conditional_writes(self) -> ConditionalWrites | None:
        """This store's atomic conditional writes (``stores.conditional``), which an
        in-place save claims its prefix with; None where it has none."""
        return None

    def publishing(self) -> DirectoryPublishing | None:
        """This store as a directory that publishes by rename (where
        ``capabilities.supports_rename``), else None: saves are then published in
        place, commit record last."""
        return None


def _nothing_to_release() -> None:
    return None


class DirectoryPublishing(Store):
    """A store that is one directory among siblings, which can be renamed atomically."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The directory's own name (its last path segment)."""

    @abstractmethod
    def resolved(self) -> DirectoryPublishing:
        """This directory with symbolic links resolved: a staging directory must be a
        sibling of the real directory, or the rename would replace the link instead."""

    @abstractmethod
    def sibling(self, name: str) -> DirectoryPublishing:
        """The directory ``name`` next to this one, in the same parent (same options)."""

    @abstractmethod
    def siblings(self, prefix: str) -> list[str]:
        """Names in the parent directory that start with ``prefix``, sorted."""

    @abstractmethod
    def rename_to(self, target: DirectoryPublishing, exchange: bool) -> bool:
        """Moves this directory to ``target`` in one step.

        ``exchange``: swap the two atomically, so ``target`` never stops existing (the old
        content is then here). Otherwise ``target`` must be missing or empty. Returns False
        when the storage cannot exchange (then nothing was moved).
        """

    @abstractmethod
    def move_entries_into(self, target: DirectoryPublishing, names: list[str]) -> None:
        """Moves this directory's entries ``names`` into ``target`` under the same names,
        one rename each, never replacing an entry ``target`` has (a ``StorageError``
        names it), then makes both directories' entries durable."""

    @abstractmethod
    def parent_locked(self) -> AbstractContextManager[None]:
        """Holds an exclusive lock on the parent directory while publishing into it."""

    @abstractmethod
    def hold_lock(self) -> int | None:
        """Takes an exclusive lock on this directory and returns its descriptor (close it
        to release); None if another process holds it."""

    @abstractmethod
    def fsync_parent(self) -> None:
        """Makes the parent's directory entries (a rename) durable."""

    @abstractmethod
    def remove_directory(self) -> None:
        """Deletes this directory and everything in it (FileNotFoundError if missing)."""

    @abstractmethod
    def held(self) -> AbstractContextManager[Any]:
        """This directory held open: a ``stores.local_files.HeldDirectory`` whose store
        reaches it whatever it is renamed to, until the context ends (or None)."""


class Location:
    """A checkpoint's root on one store, with the names the rest of shardstore uses.

    Subclasses (``format.integrity.ChecksummedLocation``, ``format.commit.PendingCheckpoint``)
    share the store and override only what they change.
    """

    def __init__(self, store: Store) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.store.describe()!r})"

    @property
    def capabilities(self) -> Capabilities:
        return self.store.capabilities

    @property
    def name_limits(self) -> NameLimits:
        return self.store.name_limits

    def describe(self, rel: str = "") -> str:
        """A human-readable address of ``rel`` for error messages."""
        return self.store.describe(rel)

    def read_bytes_or_none(self, rel: str, max_bytes: int | None = None) -> bytes | None:
        """The object's bytes or None (``Store.get``)."""
        return self.store.get(rel, max_bytes)

    def read_bytes(self, rel: str) -> bytes:
        """The object's bytes; FileNotFoundError names it when it does not exist."""
        data = self.read_bytes_or_none(rel)
        if data is None:
            raise FileNotFoundError(f"{self.describe(rel)} does not exist")
        return data

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.store.put(rel, data)

    def write_many(self, files: dict[str, bytes]) -> None:
        self.store.put_many(files)

    def write_atomic(self, rel: str, data: bytes) -> None:
        self.store.put_atomic(rel, data)

    def exists(self, rel: str) -> bool:
        return self.store.exists(rel)

    def is_empty(self) -> bool:
        """True if nothing is stored under the location (or it does not exist)."""
        return not self.store.list_dir("")

    def list_top(self, limit: int | None = 10) -> list[str]:
        """Up to ``limit`` (None: all) names directly under the location, sorted."""
        return self.store.list_dir("")[:limit]

    def list_files(self) -> list[str]:
        """Every object under the location, by relative path, sorted."""
        return self.store.list("")

    def child(self, name: str) -> Location:
        return Location(self.store.child(name))

    def remove(self, rel: str) -> None:
        self.store.delete(rel)

    def remove_tree(self, rel: str = "", keep: Collection[str] = ()) -> None:
        """Removes everything under ``rel`` but the objects ``keep`` names directly
        under it (``Store.delete_prefix``)."""
        self.store.delete_prefix(rel, keep)

    def prepare(self) -> None:
        self.store.prepare()

    def begin_writes(self) -> None:
        self.store.begin_writes()

    def end_writes(self) -> None:
        self.store.end_writes()

    def make_durable(self) -> None:
        self.store.make_durable()

    def make_directories(self, rels: Iterable[str]) -> None:
        self.store.make_directories(rels)

    def local_path(self, rel: str = "") -> Path | None:
        return self.store.local_path(rel)


def kvstore_spec(location: Location, rel: str = "") -> dict[str, Any]:
    """TensorStore kvstore spec of the directory ``rel`` of ``location`` (ends with ``/``).

    Raises:
        StorageError: TensorStore cannot reach this store (its chunks go through its own
            get/put, which TensorStore's zarr driver cannot use).
    """
    spec = location.store.chunk_access().kvstore
    if spec is None:
        raise StorageError(
            f"{location.describe()}: TensorStore cannot open this kind of store; shardstore's own save and load "
            "read it, use those (or a local path or s3:// URL)"
        )
    path = str(spec.get("path", ""))
    if rel:
        path = f"{path}{rel.strip('/')}/"
    return {**spec, "path": path}


def run_parallel(fn: Callable[[Any], None], items: Iterable[Any] | list[Any], threads: int = SMALL_FILE_WRITERS) -> None:
    """``fn`` over ``items`` on up to ``threads`` threads; the first error is raised
    (after the others have finished, so nothing runs on behind the caller's back; an
    interrupt first cancels the batches not yet begun).

    Items go to the threads in batches (about four per thread): one future per item
    cost more than writing a 4 KiB file.
    """
    items = list(items)
    if len(items) <= 1 or threads <= 1:
        for item in items:
            fn(item)
        return
    size = max(1, len(items) // (threads * 4))
    batches = [items[i : i + size] for i in range(0, len(items), size)]

    def run_batch(batch: list[Any]) -> None:
        for item in batch:
            fn(item)

    with ThreadPoolExecutor(min(threads, len(batches))) as pool:
        futures = [pool.submit(run_batch, batch) for batch in batches]
        try:
            for future in futures:
                future.result()
        except Exception:  # every batch is still attempted (a clean-up deletes all it can)
            raise
        except BaseException:  # an interrupt stops the batches not yet begun
            pool.shutdown(wait=True, cancel_futures=True)
            raise


# ------------------------------------------------------------------ chunk I/O
#
# Bytes by key, moved without copies where the storage allows, for shardstore's chunk
# encoding (``format.chunks``). A ``ChunkStore`` knows bytes and paths, nothing of arrays
# or checksums: ``put`` the concatenation of buffers, ``get_into`` the caller's buffers
# (with the few bytes after them, the encoding's trailer) or a byte range of the object
# into them (``get_range_into``, and ``get_suffix``: a sharded read's index), and
# ``share_from`` an earlier
# checkpoint's object where the storage can share it, proven against the bytes the caller
# expects (``ExpectedBytes``, which ``format.chunks.HeldChunk`` implements). Each store
# makes its own (``Store.chunk_store``): files on a local disk
# (``stores.local.FileChunkStore``), a TensorStore kvstore on object stores
# (``stores.kv_chunks.KvChunkStore``), or the store's own get and put
# (``StoreChunkStore``).


class ExpectedBytes(Protocol):
    """The bytes a shared object must hold (``ChunkStore.share_from``), as the writer
    holds them in memory."""

    @property
    def nbytes(self) -> int:
        """The object's length in bytes."""

    def holds(self, blocks: Iterable[memoryview]) -> bool:
        """Whether an object read as ``blocks`` (in order) is exactly these bytes."""

    def check(self, blocks: Iterable[memoryview], source: str) -> None:
        """Raises ChunkMismatch, naming ``source``, unless ``holds(blocks)``."""

    def md5_hex(self) -> str:
        """The MD5 of the bytes (what S3 reports as a single-part object's ETag)."""

    @property
    def source_etag(self) -> str | None:
        """The tag the earlier checkpoint's commit record bound to the object being
        shared: what its store reported when the object was written with these bytes
        (``ChunkStore.put``: an ETag, or a local file's identity,
        ``stores.file_identity``); None where the record keeps none."""


class ChunkMismatch(CheckpointingException):
    """An object shared from an earlier checkpoint does not hold the bytes being saved
    (``ChunkStore.share_from``): the caller writes them instead."""


# ``ChunkStore.ranges_of``'s reader: fills the views with the object's bytes from the offset.
RangeReader = Callable[[int, list[memoryview]], None]
# A reader's checksum, handed the bytes of a read in order as they land (``get_into_folded``).
Fold = Callable[[memoryview], None]


class ChunkStore(ABC):
    """Where encoded chunks live; knows bytes and paths, nothing of arrays.

    Attributes:
        threads: how many chunk reads or writes to run at once on this storage.
        request_bytes: about how many bytes one more request costs as much as, here: a
            read of part of a sharded object reads it whole when that adds no more
            (``format.sharding``; a local file's ranged read costs nothing more).
        tells_longer: whether ``get_into`` reads the one byte more its caller asks for
            (``get_into``), so that an object longer than expected is refused; an object
            store's ranged read cannot ask past an object's end (``KvChunkStore``), and
            ``format.integrity.verify`` compares such objects' listed sizes instead.
    """

    threads: int = DEFAULT_IO_THREADS
    request_bytes: int = 0
    tells_longer: bool = True

    @abstractmethod
    def describe(self, rel: str) -> str:
        """Where ``rel`` is, for error messages."""

    @abstractmethod
    def put(self, rel: str, buffers: Iterable[memoryview]) -> str | None:
        """Stores the concatenation of ``buffers`` at ``rel`` (no durability promise:
        the location's ``make_durable`` flushes); returns the object's ETag, without
        quotes, where the store reports one (object stores), a local file's identity
        tag (``stores.file_identity``), else None. ``buffers`` may be made while they
        are taken (``format.codecs.ChunkCodec.encode_stream``): a store that writes as
        it goes takes each just before writing it (``stores.local.FileChunkStore``),
        others take them all first."""

    @abstractmethod
    def get_into(self, rel: str, views: list[memoryview], tail: int) -> tuple[int, bytes] | None:
        """Fills ``views`` in order from the object at ``rel``; returns the bytes that
        landed in them and up to ``tail`` bytes that follow (the chunk encoding's
        trailer), or None if the object does not exist. The caller asks for one byte
        more than the object should hold (in ``tail`` or the views), to tell a longer
        object; a store that cannot read past an object's end in the same request
        (``tells_longer`` False) reads all but that byte, and refuses (StorageError) an
        object shorter than the rest. Never reads more than asked for."""

    def get_into_folded(
        self, rel: str, views: list[memoryview], tail: int, fold: Fold,
    ) -> tuple[int, bytes] | None:
        """``get_into`` that hands ``fold`` the bytes that landed in ``views``, in order
        (a reader's checksum). A store that reads in blocks calls it after each block,
        while the block is still in the CPU's cache (``stores.local.FileChunkStore``),
        so the checksum costs no second pass over memory; this default calls it once
        per view after the whole read."""
        got = self.get_into(rel, views, tail)
        if got is not None:
            fold_landed(views, got[0], fold)
        return got

    @abstractmethod
    def get_range_into(self, rel: str, offset: int, views: list[memoryview]) -> None:
        """Fills ``views`` in order with the object's bytes ``[offset, offset + total)``
        (``total``: the views' bytes); a range of no bytes reads nothing.

        Raises:
            StorageError: naming the object: it does not exist, or the range reaches
                past its end."""

    def get_range_into_folded(self, rel: str, offset: int, views: list[memoryview], fold: Fold) -> None:
        """``get_range_into`` that hands ``fold`` the bytes that landed in ``views``, in
        order, as ``get_into_folded`` does (a sharded read's checksums of its inner chunks);
        this default calls it once per view after the whole read."""
        self.get_range_into(rel, offset, views)
        fold_landed(views, sum(v.nbytes for v in views), fold)

    @abstractmethod
    def get_suffix(self, rel: str, nbytes: int) -> tuple[bytes, int] | None:
        """The object's last ``nbytes`` bytes (all of it where it is shorter) and its
        size, or None if it does not exist (a sharded read's index and where it ends)."""

    def ranges_of(self, rel: str) -> AbstractContextManager[RangeReader]:
        """The object at ``rel`` opened for many ranged reads (a load's reads of one pack,
        ``format.packs``): ``reader(offset, views)`` is ``get_range_into(rel, offset,
        views)``, safe from several threads at once, until the context ends. This default
        opens nothing (an object store's ranged GET each time); a local file store holds one
        descriptor for them all (``stores.local.FileChunkStore``)."""
        return contextlib.nullcontext(functools.partial(self.get_range_into, rel))

    def share_from(self, source: ChunkStore, rel: str, held: ExpectedBytes) -> CopiedObject | None:
        """Makes the object at ``rel`` hold ``held``'s bytes by sharing what ``source``
        holds at ``rel``, without sending them through this process where the storage
        can: a clone or hard link on a local file system, a server-side copy on an
        object store.

        The new object (with its ETag where the store reports one) only once it is
        proven to hold exactly ``held``'s bytes and their trailer, checked against what
        the object holds now (``ExpectedBytes.holds``, or an ETag the store computed
        from the copy's bytes), never against a record's word alone. None where the
        storage cannot share it (another kind of storage, no links across devices, the
        source gone, an ETag that says nothing of the bytes). Either way the caller then
        writes the bytes, which replaces whatever the attempt left at ``rel``. Never
        changes the source object.

        Raises:
            ChunkMismatch: the shared object does not hold ``held``'s bytes.
            Errors of either storage propagate; the caller decides."""
        return None


class StoreChunkStore(ChunkStore):
    """Chunks as objects of the store itself, for stores TensorStore cannot reach."""

    request_bytes = 2**62  # a range is read as the whole object (``get_range_into``)

    def __init__(self, store: Store, threads: int) -> None:
        self.store, self.threads = store, threads

    def describe(self, rel: str) -> str:
        return self.store.describe(rel)

    def put(self, rel: str, buffers: Iterable[memoryview]) -> str | None:
        self.store.put(rel, b"".join(buffers))
        return None

    def get_into(self, rel: str, views: list[memoryview], tail: int) -> tuple[int, bytes] | None:
        """Reads at most what ``fill_views`` needs (the views and ``tail``), never an
        object of unchecked size."""
        data = self.store.get(rel, max_bytes=sum(v.nbytes for v in views) + tail)
        return None if data is None else fill_views(views, memoryview(data), tail)

    def get_range_into(self, rel: str, offset: int, views: list[memoryview]) -> None:
        """Reads the whole object and copies the range out of it: these stores (memory)
        hold their objects in this process, so a range costs no transfer."""
        if not (total := sum(v.nbytes for v in views)):
            return
        data = self.store.get(rel)
        check_range(self.describe(rel), offset, total, None if data is None else len(data))
        fill_views(views, memoryview(data)[offset:], 0)  # type: ignore[index]

    def get_suffix(self, rel: str, nbytes: int) -> tuple[bytes, int] | None:
        """Reads the whole object (as ``get_range_into``)."""
        data = self.store.get(rel)
        return None if data is None else (data[max(0, len(data) - nbytes):], len(data))

    def share_from(self, source: ChunkStore, rel: str, held: ExpectedBytes) -> CopiedObject | None:
        """The store's own copy (``copy_from``), where it has one, read back and
        compared with ``held`` (these stores are in memory or otherwise cheap to read)."""
        if not isinstance(source, StoreChunkStore) or self.store.copy_from(source.store, rel) is None:
            return None
        data = self.store.get(rel, max_bytes=held.nbytes + 1)
        if data is None:
            return None
        held.check([memoryview(data)], source.describe(rel))
        return CopiedObject()


def fill_views(views: list[memoryview], data: memoryview, tail: int) -> tuple[int, bytes]:
    """Copies ``data`` into ``views`` in order; returns the bytes copied and up to
    ``tail`` bytes that follow (``ChunkStore.get_into``)."""
    at = 0
    for v in views:
        n = min(len(v), len(data) - at)
        v[:n] = data[at : at + n]
        at += n
        if n < len(v):
            break
    return at, bytes(data[at : at + tail])




def fold_landed(views: list[memoryview], nbytes: int, fold: Fold) -> None:
    """Calls ``fold`` with the first ``nbytes`` of ``views``, in order, view by view
    (``ChunkStore.get_into_folded``)."""
    for v in views:
        if nbytes <= 0:
            return
        fold(v if len(v) <= nbytes else v[:nbytes])
        nbytes -= len(v)


def check_range(where: str, offset: int, nbytes: int, size: int | None) -> None:
    """Raises StorageError, naming ``where``, unless an object of ``size`` bytes (None:
    missing) holds ``[offset, offset + nbytes)`` (``ChunkStore.get_range_into``)."""
    if size is None:
        raise StorageError(f"{where} does not exist: cannot read its bytes [{offset}, {offset + nbytes})")
    if offset < 0 or offset + nbytes > size:
        raise StorageError(
            f"{where} holds {size} bytes: the range [{offset}, {offset + nbytes}) reaches past its end "
            "(a truncated or replaced object)"
        )
