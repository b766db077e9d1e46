"""A chunk file's identity as the file system keeps it, recorded when its bytes were last
proven, so that a later save can prove a shared chunk without reading it
(``stores.local.FileChunkStore.share_from``, ``format.reuse``).

The identity is ``(st_dev, st_ino, st_size, st_mtime_ns)`` of the file, taken with
``fstat`` of the descriptor that wrote it (``FileChunkStore.put``), that it was read
and compared through, or that it was cloned from. It is kept as the chunk's tag in the
commit record's ``chunk_etags``, where object stores keep an ETag:
``file:<dev>:<ino>:<size>:<mtime_ns>:<unread>``, ``unread`` counting the saves that
shared the file since its bytes were last read (the scrub of ``format.reuse`` re-reads
the chunks unread longest first).

What a match proves: the shared file is the inode the record named, and no write or
truncation through the file system changed it since (each moves ``mtime``), short of
one in the same clock tick as shardstore's own write, before the identity was taken.
What it does not: bit rot (silent media errors change no field), nor a write whose
author then set ``mtime`` back on purpose (``os.utime``, ``touch -d``, ``rsync -t``
onto the file). The scrub of ``format.reuse`` covers both within a known number of
saves, and a load or ``verify`` checks every chunk's crc32c. ``ctime`` is not used:
every link and unlink of the inode moves it, so a keep-N manager's retention would
stale it each step.
"""

from __future__ import annotations

__all__ = ["FileIdentity"]

import os
from dataclasses import dataclass

_PREFIX = "file:"


@dataclass(frozen=True)
class FileIdentity:
    """A file's identity when its bytes were last proven (module docstring).

    Attributes:
        device, inode: ``st_dev`` and ``st_ino``.
        size: ``st_size``, bytes.
        mtime_ns: ``st_mtime_ns``.
        unread: saves that shared the file since its bytes were last read.
    """

    device: int
    inode: int
    size: int
    mtime_ns: int
    unread: int = 0

    @classmethod
    def of(cls, info: os.stat_result, unread: int = 0) -> FileIdentity:
        """The identity of the file ``info`` (an ``fstat``) describes."""
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, unread)

    @classmethod
    def parse(cls, tag: str | None) -> FileIdentity | None:
        """The identity a record's tag names; None for any other tag (an ETag, none,
        or one this version cannot read: the chunk is then proven by reading it)."""
        if not tag or not tag.startswith(_PREFIX):
            return None
        fields = tag[len(_PREFIX):].split(":")
        if len(fields) != 5 or not all(f.isdigit() for f in fields):
            return None
        return cls(*map(int, fields))

    def tag(self) -> str:
        """The record's form (at most 5 fields of 20 digits: within its 128 characters)."""
        return f"{_PREFIX}{self.device}:{self.inode}:{self.size}:{self.mtime_ns}:{self.unread}"

    def names(self, info: os.stat_result) -> bool:
        """Whether ``info`` describes this file, unchanged: the same device, inode,
        size and ``mtime_ns`` (``unread`` aside)."""
        return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns) == (
            self.device, self.inode, self.size, self.mtime_ns)
