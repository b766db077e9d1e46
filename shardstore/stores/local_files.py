"""How shardstore creates, opens and shares files on a local file system: never
through a symbolic link, never writing into a file that already exists (another
checkpoint may share it), never blocking on something that is not a regular file.

``share_file`` makes a new file hold an earlier one's content without copying its
bytes: a copy-on-write clone (``FICLONE``) where the file system has one, else a hard
link; ``stores.local.FileChunkStore.share_from`` proves what it shared.
"""

from __future__ import annotations

__all__ = ["HeldDirectory", "SharedFile", "check_inside", "create_file", "create_new_file", "hold_directory",
           "open_regular", "open_regular_file", "share_file"]

import errno
import fcntl
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from shardstore.stores.base import ChunkMismatch, StorageError


def create_file(path: str, flags: int = 0) -> int:
    """A descriptor of ``path``, created or truncated for writing (mode 0666 less the
    umask), with its directory made when it is missing (chunk files; ``put_many`` makes
    the directories of many small files in one pass first). ``flags``: more ``os.O_*``
    flags."""
    flags |= os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(path, flags, 0o666)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, flags, 0o666)


def create_new_file(path: str) -> int:
    """``create_file`` of a file no other path shares: a file already at ``path`` is
    unlinked first instead of truncated, so that a chunk hard-linked into another
    checkpoint (``format.reuse``) is never changed through this path. Links are not
    followed."""
    flags = os.O_NOFOLLOW | os.O_EXCL
    try:
        return create_file(path, flags)
    except FileExistsError:
        os.unlink(path)
        return create_file(path, flags)


# ioctl(FICLONE): a copy-on-write clone of a whole file (Btrfs, XFS, bcachefs, ...).
FICLONE = 0x40049409
# errnos that say the file system (or this pair of paths) cannot clone or link at all
_CANNOT_SHARE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.EPERM, errno.EMLINK,
                 errno.ENOSYS, errno.EBADF}
# errnos of a clone that say the source's file system cannot clone at all; the others
# (EXDEV: the target on another file system; EINVAL, EPERM, EBADF: this pair of files)
# say nothing of its next clone
_CANNOT_CLONE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.ENOSYS}
_clone_unsupported: set[int] = set()  # st_dev of file systems that cannot clone


class SharedFile(NamedTuple):
    """A file ``share_file`` shared. ``cloned_from``: for a clone, ``fstat`` of the
    descriptor cloned from, taken after the clone; None for a hard link."""

    cloned_from: os.stat_result | None


def share_file(source: str, target: str, nbytes: int) -> SharedFile | None:
    """Makes ``target`` (new) hold the content of the regular file ``source`` without
    copying bytes: a copy-on-write clone where the file system has one (the two files
    are then independent), else a hard link (one file under two names: an edit in place
    through either path changes both; shardstore itself never writes into an existing
    file, see ``create_new_file``). None, with nothing left at ``target``, where neither
    is possible.

    Raises:
        FileNotFoundError: ``source`` does not exist.
        ChunkMismatch: ``source`` is not a regular file of ``nbytes`` bytes.
    """
    info = os.lstat(source)
    if not stat.S_ISREG(info.st_mode) or info.st_size != nbytes:
        kind = f"{info.st_size} bytes" if stat.S_ISREG(info.st_mode) else "no regular file"
        raise ChunkMismatch(f"{source} holds {kind}, not the {nbytes} bytes being saved")
    if info.st_dev not in _clone_unsupported and (cloned := _clone(source, target)):
        return SharedFile(cloned)
    try:
        return SharedFile(None) if _hard_link(source, target) else None
    except FileNotFoundError:
        # the target's directory is missing, or another writer made it since the link
        # failed (reading that as "the source is gone" wrote shared chunks again): make
        # sure it exists and link once more; FileNotFoundError again: the source is gone
        os.makedirs(os.path.dirname(target), exist_ok=True)
        return SharedFile(None) if _hard_link(source, target) else None


def _hard_link(source: str, target: str) -> bool:
    """``os.link``; False where the file system cannot link this pair."""
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in _CANNOT_SHARE:
            return False
        raise
    return True


def _clone(source: str, target: str) -> os.stat_result | None:
    """A FICLONE of ``source`` into a new ``target``: ``fstat`` of the descriptor cloned
    from, after the clone; None (nothing left at ``target``)
    where this pair cannot be cloned, the source's file system remembered where it
    cannot clone at all (``_CANNOT_CLONE``): one clone across file systems, or of a file
    that cannot be (a NOCOW file on Btrfs), must not turn every later clone on that file
    system into a hard link, which shares an edit in place with the earlier step."""
    fd_in = open_regular(Path(source))
    if fd_in is None:
        raise FileNotFoundError(errno.ENOENT, "No such file", source)
    try:
        fd_out = create_new_file(target)
        try:
            fcntl.ioctl(fd_out, FICLONE, fd_in)
            return os.fstat(fd_in)
        except OSError as exc:
            if exc.errno not in _CANNOT_SHARE:
                raise
            if exc.errno in _CANNOT_CLONE:
                _clone_unsupported.add(os.fstat(fd_in).st_dev)
        finally:
            os.close(fd_out)
        os.unlink(target)
        return None
    finally:
        os.close(fd_in)


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


def check_inside(root: Path, directory: Path, real_root: str | None = None, action: str = "read it") -> None:
    """Raises StorageError if ``directory`` resolves outside ``root`` (a symbolic link
    on the way would lead a read, or a removal, into another checkpoint). ``real_root``:
    ``root`` resolved already; ``action``: what is refused, for the message."""
    real_root, real = real_root or os.path.realpath(root), os.path.realpath(directory)
    if real != real_root and not real.startswith(real_root + os.sep):
        raise StorageError(f"{directory} leads outside {root} (to {real}): a symbolic link; refusing to {action}")


# Where a process's open descriptors are named (Linux): a directory held open is reached
# through its entry here whatever name the directory has now.
PROC_FD = "/proc/self/fd"


class HeldDirectory(NamedTuple):
    """A directory held open (``hold_directory``).

    Attributes:
        store: a store of the directory, reached through the descriptor.
        fd: the descriptor.
        path: the path it was opened at."""

    store: Any
    fd: int
    path: Path

    def still_named(self) -> bool:
        """Whether ``path`` still names the directory held, and it still exists."""
        held = os.fstat(self.fd)
        try:
            now = os.stat(self.path)
        except OSError:
            return False
        return held.st_nlink > 0 and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


@contextmanager
def hold_directory(path: Path, make: Callable[[str], Any]) -> Iterator[HeldDirectory | None]:
    """The directory at ``path`` held open until the context ends, with a store of it
    made by ``make`` from the path that reaches it through the descriptor; None where
    descriptors cannot be reached by path (no ``PROC_FD``)."""
    if not os.path.isdir(PROC_FD):
        yield None
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield HeldDirectory(make(f"{PROC_FD}/{fd}"), fd, path)
    finally:
        os.close(fd)
