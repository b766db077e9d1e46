"""Where bytes go: a checkpoint location and the few operations shardstore needs on it.

A location is a local directory or an ``s3://bucket/prefix`` (``shardstore.stores.s3``). Bulk chunk I/O
does not pass through here: the location only hands TensorStore a kvstore spec. What
passes through here are the small files (``zarr.json`` documents, ``common.pt``, sharded
objects, the commit record), listing and removal, and durability.

Durability on a local disk: small files are written without a per-file fsync;
``make_durable`` then flushes the whole file system once (``syncfs``), through a
descriptor ``begin_writes`` opened before the first write, which covers every chunk
file and every directory entry in one system call instead of one per file. The commit
record alone is written with temp file + fsync + rename + fsync of the directory, so
it appears atomically and only after everything it vouches for.

Reads on a local disk trust nothing: ``open_regular_file`` refuses symbolic links,
directories that resolve outside the checkpoint, and anything but a regular file, and
records are read through a size bound. Renames, exchanges and locks for publishing a
save (``shardstore.format.commit``) are here too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import shutil
import stat
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardstore.errors import CheckpointingException

logger = logging.getLogger(__name__)

# Threads for batches of small-file writes; they release the GIL in write().
SMALL_FILE_WRITERS = 8
# Linux's NAME_MAX and PATH_MAX (the latter counts the terminating NUL), where the file
# system does not say (pathconf).
DEFAULT_NAME_MAX = 255
DEFAULT_PATH_MAX = 4096
# Bytes a save may add to the checkpoint's own path: it writes into a staging directory
# next to it whose name is longer (``shardstore.format.commit``: ``.<name>.shardstore-save-<32
# hex digits>``, 50 bytes more).
SAVE_PATH_HEADROOM = 64


class StorageError(CheckpointingException, OSError):
    """A storage operation failed; the message names the location and the object.

    A CheckpointingException (what callers catch) and an OSError (what it is)."""


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
    """

    max_name_bytes: int | None = None
    max_path_bytes: int | None = None
    path_limit: str = ""


class Location(ABC):
    """A checkpoint's root: a place where relative paths (``/``-separated) name objects."""

    # Largest object the storage takes in one write (None: no limit).
    max_object_bytes: int | None = None
    # Writes must reach stable storage before make_durable returns (local disks).
    fsync: bool = False

    @property
    def name_limits(self) -> NameLimits:
        """The longest names and relative paths this location stores (none known here)."""
        return NameLimits()

    @abstractmethod
    def describe(self, rel: str = "") -> str:
        """A human-readable address of ``rel`` for error messages."""

    @abstractmethod
    def read_bytes_or_none(self, rel: str, max_bytes: int | None = None) -> bytes | None:
        """The object's bytes, or None if it does not exist.

        ``max_bytes``: refuse (StorageError) an object larger than this: records are
        read through a bound, so a hostile one cannot make the reader allocate without
        limit. Local reads never follow a link and never open a special file.
        """

    def begin_writes(self) -> None:
        """Called before this process writes its first byte of a save (local disks
        open the descriptor that ``make_durable`` syncs through, so write-back errors
        from then on are reported). Nothing to do elsewhere."""
        return None

    def end_writes(self) -> None:
        """Releases what ``begin_writes`` holds (after a failed save; ``make_durable``
        releases it on success)."""
        return None

    def read_bytes(self, rel: str) -> bytes:
        data = self.read_bytes_or_none(rel)
        if data is None:
            raise FileNotFoundError(f"{self.describe(rel)} does not exist")
        return data

    @abstractmethod
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Writes one object (no durability guarantee until ``make_durable``)."""

    def write_many(self, files: dict[str, bytes]) -> None:
        """Writes many small objects concurrently."""
        run_parallel(lambda item: self.write_bytes(*item), list(files.items()))

    @abstractmethod
    def write_atomic(self, rel: str, data: bytes) -> None:
        """Writes one object so that readers see either nothing or all of it, durably."""

    @abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abstractmethod
    def is_empty(self) -> bool:
        """True if nothing is stored under the location (or it does not exist)."""

    @abstractmethod
    def list_top(self, limit: int | None = 10) -> list[str]:
        """Up to ``limit`` (None: all) names directly under the location, sorted."""

    @abstractmethod
    def list_files(self) -> list[str]:
        """Every object under the location, by relative path, sorted (locally: every
        entry that is not a directory, links and special files included, none followed)."""

    @abstractmethod
    def child(self, name: str) -> Location:
        """The location of the directory ``name`` under this one (same storage options)."""

    @abstractmethod
    def remove(self, rel: str) -> None:
        """Removes one object if it exists."""

    @abstractmethod
    def remove_tree(self, rel: str = "") -> None:
        """Removes everything under ``rel`` (the whole location for ``""``)."""

    @abstractmethod
    def prepare(self) -> None:
        """Makes the location ready to receive objects (creates the directory)."""

    @abstractmethod
    def make_durable(self) -> None:
        """Blocks until everything written so far by this process is on stable storage."""

    def local_path(self, rel: str = "") -> Path | None:
        """The POSIX path of ``rel`` when the location is a local file system, else None
        (enables the direct chunk I/O path of ``shardstore.format.chunks``)."""
        return None

    @abstractmethod
    def kvstore_spec(self, rel: str = "") -> dict[str, Any]:
        """TensorStore kvstore spec for the directory ``rel`` (ends with ``/``)."""

    @abstractmethod
    def tensorstore_context(self) -> dict[str, Any]:
        """TensorStore context resources suited to this storage."""


class DelegatingLocation(Location):
    """A location that passes every operation to ``inner``: subclasses change a few
    (``ChecksummedLocation`` checks reads, a pending save publishes its commit)."""

    def __init__(self, inner: Location) -> None:
        self.inner = inner

    @property
    def max_object_bytes(self) -> int | None:  # type: ignore[override]
        return self.inner.max_object_bytes

    @property
    def fsync(self) -> bool:  # type: ignore[override]
        return self.inner.fsync

    @property
    def name_limits(self) -> NameLimits:
        return self.inner.name_limits

    def describe(self, rel: str = "") -> str:
        return self.inner.describe(rel)

    def read_bytes_or_none(self, rel: str, max_bytes: int | None = None) -> bytes | None:
        return self.inner.read_bytes_or_none(rel, max_bytes)

    def begin_writes(self) -> None:
        self.inner.begin_writes()

    def end_writes(self) -> None:
        self.inner.end_writes()

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.inner.write_bytes(rel, data)

    def write_many(self, files: dict[str, bytes]) -> None:
        self.inner.write_many(files)

    def write_atomic(self, rel: str, data: bytes) -> None:
        self.inner.write_atomic(rel, data)

    def exists(self, rel: str) -> bool:
        return self.inner.exists(rel)

    def is_empty(self) -> bool:
        return self.inner.is_empty()

    def list_top(self, limit: int | None = 10) -> list[str]:
        return self.inner.list_top(limit)

    def list_files(self) -> list[str]:
        return self.inner.list_files()

    def child(self, name: str) -> Location:
        return self.inner.child(name)

    def remove(self, rel: str) -> None:
        self.inner.remove(rel)

    def remove_tree(self, rel: str = "") -> None:
        self.inner.remove_tree(rel)

    def prepare(self) -> None:
        self.inner.prepare()

    def make_durable(self) -> None:
        self.inner.make_durable()

    def local_path(self, rel: str = "") -> Path | None:
        return self.inner.local_path(rel)

    def kvstore_spec(self, rel: str = "") -> dict[str, Any]:
        return self.inner.kvstore_spec(rel)

    def tensorstore_context(self) -> dict[str, Any]:
        return self.inner.tensorstore_context()


def _raise(error: OSError) -> None:
    """``os.walk`` ignores errors unless told: a directory it cannot read is a failure."""
    raise error


class LocalLocation(Location):
    """A directory on a local or shared POSIX file system."""

    def __init__(self, path: str | os.PathLike, fsync: bool = True) -> None:
        self.root = Path(path).absolute()
        self.fsync = fsync
        self._sync_fd: int | None = None

    def __repr__(self) -> str:
        return f"LocalLocation({str(self.root)!r})"

    def _path(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def describe(self, rel: str = "") -> str:
        return str(self._path(rel))

    def local_path(self, rel: str = "") -> Path:
        return self._path(rel)

    @property
    def name_limits(self) -> NameLimits:
        """NAME_MAX and PATH_MAX of the file system that holds (or will hold) the
        checkpoint, PATH_MAX less the path of the save's staging directory, which every
        file of a save is written under."""
        root = self.root.resolve()  # a save writes under the real path, links resolved
        existing = next(p for p in (root, *root.parents) if p.exists())
        used = len(os.fsencode(root)) + SAVE_PATH_HEADROOM + 1  # "/" before the relative path
        path_max = _pathconf(existing, "PC_PATH_MAX", DEFAULT_PATH_MAX)
        return NameLimits(
            _pathconf(existing, "PC_NAME_MAX", DEFAULT_NAME_MAX),
            path_max - 1 - used,
            f"the file system's PATH_MAX of {path_max} bytes, less {used} for the checkpoint's staging directory",
        )

    def read_bytes_or_none(self, rel: str, max_bytes: int | None = None) -> bytes | None:
        path = self._path(rel)
        try:
            fd = open_regular_file(self.root, path)
            if fd is None:
                return None
            with os.fdopen(fd, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if max_bytes is not None and size > max_bytes:
                    raise StorageError(f"{path} holds {size} bytes, more than the {max_bytes} a record may have")
                data = f.read(size + 1)  # one more: a file that grows while read is refused
        except OSError as exc:
            raise StorageError(f"Cannot read {path}: {exc}") from exc
        if len(data) != size:
            raise StorageError(f"{path} changed size while it was read ({size} -> {len(data)}+ bytes)")
        return data

    def begin_writes(self) -> None:
        if self.fsync and self._sync_fd is None:
            self.prepare()
            self._sync_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)

    def end_writes(self) -> None:
        fd, self._sync_fd = self._sync_fd, None
        if fd is not None:
            os.close(fd)

    def write_many(self, files: dict[str, bytes]) -> None:
        run_parallel(lambda item: self.write_bytes(*item), list(files.items()))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Writes one file; ``create_file`` makes its directory (a serial pass of
        ``mkdir``s before the parallel writes measured no faster on a 5,000-array save)."""
        path = os.path.join(self.root, rel)
        try:
            fd = create_file(path)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        except OSError as exc:
            raise StorageError(f"Cannot write {path}: {exc}") from exc

    def write_atomic(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Mode 0666 less the umask, like every other file (mkstemp's 0600 would keep
            # teammates from loading the checkpoint).
            tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            if self.fsync:
                _fsync_directory(path.parent)
        except OSError as exc:
            raise StorageError(f"Cannot write {path}: {exc}") from exc

    def exists(self, rel: str) -> bool:
        return self._path(rel).exists()

    def is_empty(self) -> bool:
        return not self.root.exists() or next(self.root.iterdir(), None) is None

    def list_top(self, limit: int | None = 10) -> list[str]:
        try:
            return sorted(os.listdir(self.root))[:limit]
        except FileNotFoundError:
            return []

    def list_files(self) -> list[str]:
        found = []
        for directory, subdirectories, files in os.walk(self.root, onerror=_raise):  # never follows links
            prefix = Path(directory).relative_to(self.root).as_posix()
            links = [d for d in subdirectories if os.path.islink(os.path.join(directory, d))]
            found.extend(name if prefix == "." else f"{prefix}/{name}" for name in (*files, *links))
        return sorted(found)

    def child(self, name: str) -> LocalLocation:
        return LocalLocation(self._path(name), fsync=self.fsync)

    def sibling(self, name: str) -> LocalLocation:
        """The location ``name`` next to this one, in the same parent directory."""
        return LocalLocation(self.root.parent / name, fsync=self.fsync)

    def siblings(self, prefix: str) -> list[str]:
        """Names in the parent directory that start with ``prefix``."""
        try:
            return sorted(n for n in os.listdir(self.root.parent) if n.startswith(prefix))
        except FileNotFoundError:
            return []

    def rename_to(self, target: LocalLocation, exchange: bool) -> bool:
        """Moves this directory to ``target`` in one step (same file system).

        ``exchange``: swap the two directories atomically (``renameat2`` with
        ``RENAME_EXCHANGE``), so ``target`` never stops existing; the old content is
        then here. Otherwise ``target`` must be missing or an empty directory, which
        rename(2) replaces atomically. Returns False when the file system cannot
        exchange (then nothing was moved).
        """
        try:
            if not exchange:
                os.rename(self.root, target.root)
                return True
            if _rename_exchange(self.root, target.root):
                return True
        except OSError as exc:
            raise StorageError(f"Cannot move {self.root} to {target.root}: {exc}") from exc
        return False

    @contextlib.contextmanager
    def parent_locked(self) -> Iterator[None]:
        """Holds an exclusive ``flock`` on the parent directory: shardstore processes
        publishing into the same directory take turns (held for milliseconds). Where
        the file system has no flock (some network file systems), runs unlocked."""
        fd = os.open(self.root.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                logger.debug("No flock on %s (%s): publishing unlocked", self.root.parent, exc)
            yield
        finally:
            os.close(fd)  # releases the lock

    def hold_lock(self) -> int | None:
        """Takes an exclusive ``flock`` on this directory and returns its descriptor
        (close it to release); None if another process holds it. A save holds its
        staging directory's lock for as long as it runs, so a crashed save's
        directory (lock free) can be told from a running one's."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:  # no flock on this file system: treat as not held
            logger.debug("No flock on %s (%s)", self.root, exc)
        return fd

    def fsync_parent(self) -> None:
        if self.fsync:
            _fsync_directory(self.root.parent)

    def remove(self, rel: str) -> None:
        self._path(rel).unlink(missing_ok=True)

    def remove_tree(self, rel: str = "") -> None:
        path = self._path(rel)
        if rel == "":
            # Keep the directory itself: the caller may hold it open or own its permissions.
            for child in path.iterdir() if path.exists() else ():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

    def prepare(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"Cannot create checkpoint directory {self.root}: {exc}") from exc

    def make_durable(self) -> None:
        """``syncfs`` through the descriptor ``begin_writes`` opened before the first
        write: Linux reports a write-back error to a descriptor only if it happened
        after the descriptor was opened (errseq), so one opened now could miss it."""
        if not self.fsync:
            return
        fd, self._sync_fd = self._sync_fd, None
        if fd is None:
            if not self.root.exists():
                return
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _syncfs(fd, self.root)
        finally:
            os.close(fd)

    def kvstore_spec(self, rel: str = "") -> dict[str, Any]:
        path = str(self._path(rel))
        return {"driver": "file", "path": path if path.endswith("/") else path + "/"}

    def tensorstore_context(self) -> dict[str, Any]:
        # No fsync per chunk file: make_durable flushes the file system once instead.
        return {"file_io_sync": False}


def run_parallel(fn: Any, items: list[Any], threads: int = SMALL_FILE_WRITERS) -> None:
    """``fn`` over ``items`` on up to ``threads`` threads; the first error is raised
    (after the others have finished, so nothing runs on behind the caller's back).

    Items go to the threads in batches (about four per thread): one future per item
    cost more than writing a 4 KiB file.
    """
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
        for future in [pool.submit(run_batch, batch) for batch in batches]:
            future.result()


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _pathconf(path: Path, name: str, default: int) -> int:
    """``pathconf(path, name)``, or ``default`` where the system does not say."""
    try:
        value = os.pathconf(path, name)
    except (OSError, ValueError):
        return default
    return value if value > 0 else default


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths; False where the C library or file system cannot."""
    renameat2 = getattr(_libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _syncfs(fd: int, path: Path) -> None:
    """Flushes the file system holding ``fd`` (a directory ``path``): data, inodes and
    directory entries."""
    syncfs = getattr(_libc, "syncfs", None)
    if syncfs is None:
        os.sync()
        return
    if syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise StorageError(err, f"syncfs failed on {path}: {os.strerror(err)}")


def open_regular_file(root: Path, path: Path) -> int | None:
    """A read-only descriptor of ``path``, a regular file inside ``root``; None if it
    does not exist.

    Refused (StorageError): a symbolic link (``O_NOFOLLOW``), a directory on the way
    that resolves outside ``root``, and anything but a regular file: a FIFO would block
    the reader (``O_NONBLOCK`` keeps even the open from waiting), ``/dev/zero`` would
    never end.
    """
    check_inside(root, path.parent)
    return open_regular(path)


def create_file(path: str, flags: int = 0) -> int:
    """A descriptor of ``path``, created or truncated for writing (mode 0666 less the
    umask), with its directory made when it is missing: the first file written into a
    directory makes it, so no pass of ``mkdir``s runs before the writes. ``flags``: more
    ``os.O_*`` flags."""
    flags |= os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(path, flags, 0o666)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, flags, 0o666)


def check_inside(root: Path, directory: Path, real_root: str | None = None) -> None:
    """Raises StorageError if ``directory`` resolves outside ``root`` (a symbolic link
    on the way would lead a read into another checkpoint). ``real_root``: ``root``
    resolved already."""
    real_root, real = real_root or os.path.realpath(root), os.path.realpath(directory)
    if real != real_root and not real.startswith(real_root + os.sep):
        raise StorageError(f"{directory} leads outside {root} (to {real}): a symbolic link; refusing to read it")


class DirectoryGuard:
    """``check_inside`` for the directories below one root, each checked once (a
    checkpoint of 5,000 small arrays reads 5,000 directories: resolving the root again
    for each cost as much as reading the chunk)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._real_root: str | None = None
        self._checked: set[str] = set()

    def check(self, rel_dir: str) -> None:
        """Checks ``root/rel_dir`` (``""``: the root itself needs no check)."""
        if not rel_dir or rel_dir in self._checked:
            return
        if self._real_root is None:
            self._real_root = os.path.realpath(self.root)
        check_inside(self.root, os.path.join(self.root, rel_dir), self._real_root)
        self._checked.add(rel_dir)  # set.add is atomic: reader threads share the guard


def open_regular(path: Path) -> int | None:
    """``open_regular_file`` without the check of the directories on the way."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StorageError(f"{path} is a symbolic link; refusing to follow it out of the checkpoint") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StorageError(f"{path} is not a regular file; refusing to read it")
    return fd
