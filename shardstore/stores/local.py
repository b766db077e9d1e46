"""Local and shared POSIX file systems: a checkpoint is a directory, each key a file.

Durability: files are written without a per-file fsync; ``make_durable`` then flushes
the whole file system once (``syncfs``), through a descriptor ``begin_writes`` opened
before the first write: one system call for every file and directory entry. A chunk
file of ``EARLY_WRITEBACK_BYTES`` or more starts its write-back once written
(``start_writeback``), so that ``syncfs`` finds most pages clean. ``put_atomic`` (the
commit record) writes a temporary file, fsyncs it, renames it over the key and fsyncs
the directory: it appears whole, after everything it vouches for.

Reads trust nothing: ``open_regular_file`` refuses symbolic links, directories that
resolve outside the checkpoint, and anything but a regular file; records are read
through a size bound; removals never go through a symbolic link. Chunks bypass
``get``/``put``: ``chunk_access`` hands ``format.chunks`` the directory.

Publishing (``stores.base.DirectoryPublishing``): renames, atomic exchanges
(``renameat2``), ``flock``s and directories held open, which ``format`` uses.
"""

from __future__ import annotations

__all__ = [
    "FileChunkStore", "LocalStore", "check_inside", "open_regular", "open_regular_file", "start_writeback",
]

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import stat
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path

from shardstore.stores.base import (
    DEFAULT_IO_THREADS,
    STREAM_BLOCK_BYTES,
    Capabilities,
    ChunkAccess,
    ChunkStore,
    CopiedObject,
    DirectoryPublishing,
    ExpectedBytes,
    Fold,
    NameLimits,
    RangeReader,
    StorageError,
    Store,
    atomic_temp_name,
    check_range,
    fold_landed,
    run_parallel,
)
from shardstore.stores.file_identity import FileIdentity
from shardstore.stores.local_files import (  # check_inside, open_regular_file: imported from here too
    HeldDirectory,
    check_inside,
    create_file,
    create_new_file,
    hold_directory,
    open_regular,
    open_regular_file,
    share_file,
)

logger = logging.getLogger(__name__)

# Linux's NAME_MAX and PATH_MAX (the latter counts the terminating NUL), where the file
# system does not say (pathconf).
DEFAULT_NAME_MAX = 255
DEFAULT_PATH_MAX = 4096
# Bytes a save may add to the checkpoint's own path: it writes into a staging directory
# next to it whose name is longer (``shardstore.format.commit``: ``.<name>.shardstore-save-<32
# hex digits>``, 50 bytes more).
SAVE_PATH_HEADROOM = 64


def _raise_unless_missing(top: Path) -> Callable[[OSError], None]:
    """``os.walk`` ignores errors unless told: a directory it cannot read is a failure;
    a listing of a directory that does not exist is empty."""

    def handle(error: OSError) -> None:
        if isinstance(error, FileNotFoundError) and Path(error.filename or "") == top:
            return
        raise error

    return handle


def _tensorstore_path(root: Path) -> Path:
    """``root`` as TensorStore's file driver takes it: that driver refuses a path with
    ``..`` segments, so such a root is resolved as the kernel resolves it (a ``..`` after
    a symbolic link leads out of the link's target, not back to the link's parent)."""
    return Path(os.path.realpath(root)) if ".." in root.parts else root


class LocalStore(DirectoryPublishing):
    """A directory on a local or shared POSIX file system.

    Args:
        path: the directory (need not exist yet).
        fsync: make writes durable (``make_durable``, ``put_atomic``); off for scratch
            space and tests.
    """

    def __init__(self, path: str | os.PathLike, fsync: bool = True) -> None:
        self.root = Path(path).absolute()
        self.fsync = fsync
        self.capabilities = Capabilities(
            is_local_filesystem=True, supports_rename=True, supports_fsync=fsync, shared_across_processes=True
        )
        self._sync_fd: int | None = None

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def __getstate__(self) -> dict:
        # A descriptor means nothing in another process (a spawned writer, as Megatron's
        # persistent checkpoint worker): that process opens its own before it writes.
        return {**self.__dict__, "_sync_fd": None, "_was_writing": self._sync_fd is not None}

    def __setstate__(self, state: dict) -> None:
        was_writing = state.pop("_was_writing", False)
        self.__dict__.update(state)
        if was_writing:
            self.begin_writes()

    def _path(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def describe(self, key: str = "") -> str:
        return str(self._path(key))

    def local_path(self, key: str = "") -> Path:
        return self._path(key)

    def chunk_access(self) -> ChunkAccess:
        # No fsync per chunk file: make_durable flushes the file system once instead.
        return ChunkAccess(self.root, {"driver": "file", "path": f"{_tensorstore_path(self.root)}/"},
                           {"file_io_sync": False})

    def chunk_store(self, io_concurrency: int, local_threads: int = DEFAULT_IO_THREADS) -> FileChunkStore:
        """Chunk files under the root, written and read in place (``writev``/``readv``)
        by ``local_threads`` threads, at most ``io_concurrency``: more did not help on
        local disks."""
        return FileChunkStore(self.root, min(io_concurrency, local_threads))

    def publishing(self) -> LocalStore:
        return self

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

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """Never follows a link and never opens a special file."""
        path = self._path(key)
        try:
            fd = open_regular_file(self.root, path)
            if fd is None:
                return None
            with os.fdopen(fd, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if max_bytes is not None and size > max_bytes:
                    raise StorageError(f"{path} holds {size} bytes, more than the {max_bytes} expected there")
                data = f.read(size + 1)  # one more: a file that grows while read is refused
        except OSError as exc:
            raise StorageError(f"Cannot read {path}: {exc}") from exc
        if len(data) != size:
            raise StorageError(f"{path} changed size while it was read ({size} -> {len(data)}+ bytes)")
        return data

    def size(self, key: str) -> int | None:
        """The regular file's size, under ``get``'s rules (no link followed)."""
        path = self._path(key)
        try:
            fd = open_regular_file(self.root, path)
        except OSError as exc:
            raise StorageError(f"Cannot read {path}: {exc}") from exc
        if fd is None:
            return None
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def begin_writes(self) -> None:
        if self.fsync and self._sync_fd is None:
            self.prepare()
            self._sync_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)

    def end_writes(self) -> None:
        fd, self._sync_fd = self._sync_fd, None
        if fd is not None:
            os.close(fd)

    def put_many(self, objects: dict[str, bytes]) -> None:
        """Makes the files' directories in one serial pass (``make_directories``), then
        writes the files on threads."""
        self.make_directories({os.path.dirname(key) for key in objects})
        run_parallel(lambda item: self.put(*item), list(objects.items()))

    def make_directories(self, prefixes: Iterable[str]) -> None:
        """Makes the directories in one serial pass, parents first: ``mkdir``s in one
        parent take its lock in turn, and threads racing for it made 10,000 arrays'
        directories about twice as slow as one thread."""
        root = os.path.join(self.root, "")  # one join, not one per directory (6 ms of 10,000)
        for directory in sorted(set(prefixes) - {""}):
            path = root + directory
            try:
                os.mkdir(path)
            except FileExistsError:
                pass
            except FileNotFoundError:  # a parent outside ``objects``' own directories
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"Cannot create the directory {path}: {exc}") from exc

    def put(self, key: str, data: bytes) -> None:
        """Writes one file; ``create_file`` makes its directory when it is missing."""
        path = os.path.join(self.root, key)
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

    def put_atomic(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Mode 0666 less the umask, like every other file (mkstemp's 0600 would keep
            # teammates from loading the checkpoint).
            tmp = path.parent / atomic_temp_name(path.name)
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

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def list_dir(self, prefix: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list(self, prefix: str = "") -> list[str]:
        found = []
        top = self._path(prefix)
        for directory, subdirectories, files in os.walk(top, onerror=_raise_unless_missing(top)):  # never follows links
            base = Path(directory).relative_to(self.root).as_posix()
            links = [d for d in subdirectories if os.path.islink(os.path.join(directory, d))]
            found.extend(name if base == "." else f"{base}/{name}" for name in (*files, *links))
        return sorted(found)

    def child(self, name: str) -> LocalStore:
        return LocalStore(self._path(name), fsync=self.fsync)

    def enclosing(self) -> list[Store]:
        """The directories that hold the real directory (links resolved: a save writes there)."""
        return [LocalStore(parent, fsync=self.fsync) for parent in self.root.resolve().parents]

    # ------------------------------------------------------------------ publishing

    @property
    def name(self) -> str:
        return self.root.name

    def resolved(self) -> LocalStore:
        return LocalStore(self.root.resolve(), fsync=self.fsync)

    def sibling(self, name: str) -> LocalStore:
        return LocalStore(self.root.parent / name, fsync=self.fsync)

    def held(self) -> contextlib.AbstractContextManager[HeldDirectory | None]:
        return hold_directory(self.root, lambda path: LocalStore(path, fsync=self.fsync))

    def siblings(self, prefix: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.root.parent) if n.startswith(prefix))
        except FileNotFoundError:
            return []

    def rename_to(self, target: DirectoryPublishing, exchange: bool) -> bool:
        """``rename(2)``, which replaces a missing or empty ``target`` atomically, or
        ``renameat2`` with ``RENAME_EXCHANGE`` (same file system)."""
        destination = target.local_path()
        assert destination is not None  # publishing renames within one file system
        try:
            if not exchange:
                os.rename(self.root, destination)
                return True
            if _rename_exchange(self.root, destination):
                return True
        except OSError as exc:
            raise StorageError(f"Cannot move {self.root} to {destination}: {exc}") from exc
        return False

    def move_entries_into(self, target: DirectoryPublishing, names: list[str]) -> None:
        destination = target.local_path()
        assert destination is not None  # publishing renames within one file system
        for name in names:
            try:
                _rename_no_replace(self.root / name, destination / name)
            except OSError as exc:
                raise StorageError(f"Cannot move {self.root / name} to {destination / name}: {exc}") from exc
        if self.fsync:
            _fsync_directory(destination)
            _fsync_directory(self.root)

    @contextlib.contextmanager
    def parent_locked(self) -> Iterator[None]:
        """An exclusive ``flock`` on the parent directory: shardstore processes
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
        """A save holds its staging directory's ``flock`` for as long as it runs, so a
        crashed save's directory (lock free) can be told from a running one's."""
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

    def remove_directory(self) -> None:
        shutil.rmtree(self.root)

    # ------------------------------------------------------------------ removal, durability

    def delete(self, key: str) -> None:
        """Removes the file ``key``, never through a symbolic link (``_removable``)."""
        self._removable(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str = "", keep: Collection[str] = ()) -> None:
        """Removes ``prefix`` (a directory with all below it, or a file), never through a
        symbolic link (``_removable``); links below it are removed, never followed.
        With ``keep``, the directory and the entries ``keep`` names stay."""
        path = self._removable(prefix)
        if prefix == "" or keep:
            # Keep the directory itself: the caller may hold it open or own its permissions.
            for child in path.iterdir() if path.is_dir() else ():
                if child.name in keep:
                    continue
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

    def _removable(self, key: str) -> Path:
        """The path of ``key``, once checked safe to remove: every directory on the way
        resolves inside the root (``check_inside``: a link there would lead the removal
        into another checkpoint) and ``key`` itself is no symbolic link, which shardstore
        never writes (the root itself, ``""``, may be one: the caller named it).

        Raises:
            StorageError: naming the path, either way."""
        path = self._path(key)
        if not key:
            return path
        check_inside(self.root, path.parent, action="delete through it")
        if path.is_symlink():
            raise StorageError(
                f"{path} is a symbolic link, which shardstore never writes; refusing to delete through it. "
                "Remove the link yourself if it is not needed"
            )
        return path

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


_RENAME_EXCHANGE = 2
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _pathconf(path: Path, name: str, default: int) -> int:
    """``pathconf(path, name)``, or ``default`` where the system does not say."""
    try:
        value = os.pathconf(path, name)
    except (OSError, ValueError):
        return default
    return value if value > 0 else default


def _renameat2(source: Path, destination: Path, flags: int) -> bool:
    """``renameat2(2)`` with ``flags``; False where the C library or file system lacks
    it (nothing was moved), an OSError for any other failure."""
    renameat2 = getattr(_libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(destination), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(source))


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths; False where the C library or file system cannot."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def _rename_no_replace(source: Path, destination: Path) -> None:
    """``rename(2)`` that never replaces ``destination``: ``renameat2`` with
    ``RENAME_NOREPLACE``; where the C library or file system lacks it, a check just
    before the rename (the caller holds the parent's lock against shardstore's own
    publishers)."""
    if _renameat2(source, destination, _RENAME_NOREPLACE):
        return
    if os.path.lexists(destination):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(destination))
    os.rename(source, destination)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The C library's symbols as the interpreter links them (renameat2, syncfs): ``CDLL(None)``
# looks them up in the running process, without ``find_library``, which runs ``ldconfig``.
_libc = ctypes.CDLL(None, use_errno=True)


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


# sync_file_range(2)'s flag that starts write-back of a file's dirty pages without
# waiting for it.
_SYNC_FILE_RANGE_WRITE = 2
# errnos that say the file system or kernel has no sync_file_range: nothing started,
# ``make_durable`` flushes the file as it would have anyway.
_NO_SYNC_FILE_RANGE = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ESPIPE}


def _sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> int | None:
    """``sync_file_range(2)`` through the C library (its result), or None where the C
    library has none. Looked up on each call, as ``_syncfs`` does: a ctypes function is
    not hashable, and what indexes a module's callables (tests/test_collective_counts.py)
    needs them to be."""
    function = getattr(_libc, "sync_file_range", None)
    if function is None:
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return function(fd, offset, nbytes, flags)


def start_writeback(fd: int) -> None:
    """Starts writing ``fd``'s dirty pages to the disk and returns without waiting
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``; Linux). A hint, not a durability
    promise: ``make_durable``'s ``syncfs`` still flushes the data, the inodes and the
    directory entries. Nothing happens where the C library or file system lacks it.

    Raises:
        OSError: the kernel refused the write-back (an I/O error)."""
    if _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) in (None, 0):
        return
    err = ctypes.get_errno()
    if err not in _NO_SYNC_FILE_RANGE:
        raise OSError(err, os.strerror(err))


class DirectoryGuard:
    """``check_inside`` for the directories below one root, each checked once (a
    checkpoint of 5,000 small arrays reads 5,000 directories: resolving the root again
    for each cost as much as reading the chunk; resolving each directory in full with
    ``realpath``, an ``lstat`` per component, took half of a 10,000-array load's CPU)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._real_root: str | None = None
        self._checked: set[str] = set()

    def check(self, rel_dir: str) -> None:
        """Checks ``root/rel_dir`` (``""``: the root itself needs no check): its parent
        first, then one ``lstat`` of its last component, which inside a checked parent
        is inside unless it is a symbolic link (only a link, or a ``.``/``..``
        component, is resolved in full: ``check_inside``)."""
        if not rel_dir or rel_dir in self._checked:
            return
        parent, _, name = rel_dir.rpartition("/")
        self.check(parent)
        path = f"{self.root}/{rel_dir}"  # as the reads join it (``FileChunkStore``), never os.path.join
        try:
            plain = name not in ("", ".", "..") and not stat.S_ISLNK(os.lstat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):  # nothing there to lead anywhere: the read says so
            return
        if not plain:
            if self._real_root is None:
                self._real_root = os.path.realpath(self.root)
            check_inside(self.root, path, self._real_root)
        self._checked.add(rel_dir)  # set.add is atomic: reader threads share the guard


# ------------------------------------------------------------------ chunk I/O

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
# Chunk files at least this large start their write-back once written (``put``); smaller
# ones are left to ``make_durable``'s one ``syncfs``, in fewer, larger requests. FSDP2's
# 512 KiB blocks at 2 ranks: 0.79-0.89x DCP's writer's speed with 1 MiB, 1.08-1.12x now.
EARLY_WRITEBACK_BYTES = 256 << 10
# The most bytes one ``preadv`` of a chunk asks for. The kernel's readahead runs ahead
# of a stream of such reads, while one read of a whole chunk file waits for each
# readahead window in turn: cold reads of eight 32 MiB files by eight threads took
# 131 ms (121-141) in 1 MiB reads against 152 ms (145-187) in whole-file reads.
READ_BLOCK_BYTES = 1 << 20
# Bytes read at a time when a shared file is read back to check it.
CHECK_READ_BYTES = 4 * 2**20


def _file_blocks(fd: int, limit: int) -> Iterator[memoryview]:
    """The bytes of ``fd`` from its start in blocks, at most ``limit`` in all; each
    block is valid until the next one is read."""
    buffer = memoryview(bytearray(min(limit, CHECK_READ_BYTES)))
    at = 0
    while at < limit and (n := os.preadv(fd, [buffer[: min(len(buffer), limit - at)]], at)):
        yield buffer[:n]
        at += n


class FileChunkStore(ChunkStore):
    """Chunks as files under a local directory."""

    def __init__(self, root: Path, threads: int = DEFAULT_IO_THREADS) -> None:
        self.root, self.threads = root, threads
        # Paths as strings: pathlib's joins cost more than a 4 KiB chunk's I/O.
        self._prefix = os.path.join(root, "")
        self._guard = DirectoryGuard(root)

    def describe(self, rel: str) -> str:
        return self._prefix + rel

    def put(self, rel: str, buffers: Iterable[memoryview]) -> str:
        """Returns the file's identity tag (``stores.file_identity``). Takes the pieces in order and writes them as they come: one ``writev``
        once they add up to ``STREAM_BLOCK_BYTES`` or ``IOV_MAX`` pieces (a shard of
        many inner chunks has more than one call takes), each short write resumed. A
        file of at least ``EARLY_WRITEBACK_BYTES`` then starts its write-back
        (``start_writeback``), so that the disk works while the next chunks are
        written and the location's ``make_durable`` finds most pages clean."""
        fd = create_new_file(self._prefix + rel)
        try:
            batch: list[memoryview] = []
            size = written = 0
            for piece in buffers:
                batch.append(piece)
                size += len(piece)
                if size >= STREAM_BLOCK_BYTES or len(batch) == IOV_MAX:
                    _write_all(fd, batch)
                    batch, written, size = [], written + size, 0
            _write_all(fd, batch)
            if written + size >= EARLY_WRITEBACK_BYTES:
                start_writeback(fd)
            return FileIdentity.of(os.fstat(fd)).tag()  # the written file's, for a later save's proof
        finally:
            os.close(fd)

    def get_into(self, rel: str, views: list[memoryview], tail: int) -> tuple[int, bytes] | None:
        return self._get_into(rel, views, tail, None)

    def get_into_folded(self, rel: str, views: list[memoryview], tail: int, fold: Fold) -> tuple[int, bytes] | None:
        """``fold`` runs after each ``preadv`` block on the bytes it landed, while they
        are in cache: eight threads of two ranks reading 32 MiB chunks evict a chunk
        from the 32 MiB L3 before a crc32c pass after the read reaches it (the load's
        CPU time went from 69 to 58 ms per 256 MiB rank)."""
        return self._get_into(rel, views, tail, fold)

    def _get_into(self, rel: str, views: list[memoryview], tail: int, fold: Fold | None) -> tuple[int, bytes] | None:
        fd = self._open(rel)
        if fd is None:
            return None
        try:
            got = _read_at(fd, views, 0, fold)
            return got, os.pread(fd, tail, got)
        finally:
            os.close(fd)

    def get_range_into(self, rel: str, offset: int, views: list[memoryview]) -> None:
        self.get_range_into_folded(rel, offset, views, None)

    def get_range_into_folded(self, rel: str, offset: int, views: list[memoryview], fold: Fold | None) -> None:
        """``preadv`` straight into ``views``, ``fold`` after each block as ``get_into_folded``,
        after the same checks as ``get_into`` (one read of ``ranges_of``; none opens nothing)."""
        if sum(v.nbytes for v in views):
            with self.ranges_of(rel) as read:
                read(offset, views, fold)  # type: ignore[call-arg]

    @contextlib.contextmanager
    def ranges_of(self, rel: str) -> Iterator[RangeReader]:
        """One descriptor (and one ``fstat``) for every ranged read of ``rel`` until the
        context ends, then closed (also on errors): a load of a pack's members paid an
        open, ``fstat`` and close per member (issue 44.6). Each read is checked against
        the file's size when opened (a missing file, a range past its end) and against
        the bytes it got (a file that shrank while read)."""
        fd = self._open(rel)

        def read(offset: int, views: list[memoryview], fold: Fold | None = None) -> None:
            if not (total := sum(v.nbytes for v in views)):
                return
            check_range(self.describe(rel), offset, total, size)
            got = _read_at(fd, views, offset, fold)  # type: ignore[arg-type]
            check_range(self.describe(rel), offset, total, offset + got)  # it shrank while read

        try:
            size = None if fd is None else os.fstat(fd).st_size
            yield read
        finally:
            if fd is not None:
                os.close(fd)

    def get_suffix(self, rel: str, nbytes: int) -> tuple[bytes, int] | None:
        fd = self._open(rel)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            start = max(0, size - nbytes)
            data = os.pread(fd, size - start, start)
        finally:
            os.close(fd)
        check_range(self.describe(rel), start, size - start, start + len(data))
        return data, size

    def _open(self, rel: str) -> int | None:
        """A read-only descriptor of the regular file ``rel`` (None: missing); no link
        is followed, nor a directory on the way that leads outside the root."""
        self._guard.check(rel.rpartition("/")[0])
        return open_regular(self._prefix + rel)

    def share_from(self, source: ChunkStore, rel: str, held: ExpectedBytes) -> CopiedObject | None:
        """A clone (copy-on-write, where the file system has it) or else a hard link of
        the source's file (only a regular file of the expected size inside the source's
        directory; no symbolic link is followed), proven by the identity the source's
        record keeps (``held.source_etag``, ``stores.file_identity``): ``fstat`` of the
        new file's descriptor (a link: the same inode) or of the one cloned from, after
        the clone. Where it was never recorded or does not match, the new file is read
        back whole and compared with ``held`` (a hard link: the source's bytes as they
        are now). The object returned carries the new file's identity tag."""
        if not isinstance(source, FileChunkStore):
            return None
        source._guard.check(rel.rpartition("/")[0])
        try:
            if not (shared := share_file(source._prefix + rel, self._prefix + rel, held.nbytes)):
                return None
        except FileNotFoundError:  # the source chunk is gone (deleted meanwhile)
            return None
        if (fd := open_regular(self._prefix + rel)) is None:
            return None
        try:
            info = os.fstat(fd)  # before any read: a write during the read moves mtime past it
            recorded = FileIdentity.parse(held.source_etag)
            if recorded is not None and recorded.names(shared.cloned_from or info):
                return CopiedObject(FileIdentity.of(info, recorded.unread + 1).tag())
            held.check(_file_blocks(fd, held.nbytes + 1), source.describe(rel))
            return CopiedObject(FileIdentity.of(info).tag())
        finally:
            os.close(fd)


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    """``writev`` of ``buffers`` (at most ``IOV_MAX``) until all is written."""
    pending: list = buffers
    while pending:
        pending = _advance(pending, os.writev(fd, pending))


def _read_at(fd: int, views: list[memoryview], offset: int, fold: Fold | None = None) -> int:
    """``preadv`` of ``views`` from ``offset``, at most ``IOV_MAX`` views and
    ``READ_BLOCK_BYTES`` per call, until they are full or the file ends; returns the
    bytes read. ``fold``: called with the bytes of each call, in order, as they land."""
    got, pending = 0, views
    while pending and (n := os.preadv(fd, _head(pending, READ_BLOCK_BYTES), offset + got)):
        got += n
        if fold is not None:
            fold_landed(pending, n, fold)
        pending = _advance(pending, n)
    return got


def _head(buffers: list, limit: int) -> list:
    """The first ``IOV_MAX`` of ``buffers``, cut after ``limit`` bytes."""
    head, total = buffers[:IOV_MAX], 0
    for i, b in enumerate(head):
        total += len(b)
        if total >= limit:
            head = head[: i + 1]
            head[i] = memoryview(b)[: len(b) - (total - limit)]
            break
    return head


def _advance(buffers: list, n: int) -> list:
    """The part of ``buffers`` left after ``n`` bytes were transferred (one slice of
    the list per call: a scatter read of 16,384 rows was quadratic when it dropped the
    consumed buffers one at a time)."""
    done = 0
    while done < len(buffers) and n >= len(buffers[done]):
        n -= len(buffers[done])
        done += 1
    rest = buffers[done:]
    if rest and n:
        rest[0] = memoryview(rest[0])[n:]
    return rest
