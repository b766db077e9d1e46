"""Verified bytes: checksums of non-array files, and a whole-checkpoint check.

Array chunks carry their own crc32c (Zarr's ``crc32c`` codec), checked by every
reader. The other files (common state, sharded objects, ``metadata.json``) are
checksummed in the commit record at commit time; a load reads them through
``ChecksummedLocation``, which refuses bytes that do not match.

``verify(checkpoint_dir)`` reads everything a checkpoint vouches for (every chunk of
every array, every listed file) and returns a report naming each missing or corrupt
object, by array key and chunk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from shardstore.chunk_io import ArrayChunks, ChunkStore, chunk_store_for
from shardstore.core import CONFIG_FNAME, CheckpointingException
from shardstore.format import COMMIT_RECORD, ArrayRecord, CommitRecord, checksum, read_commit_record
from shardstore.locations import open_location
from shardstore.progress import Tick, operation, progress_shown, tracked
from shardstore.storage import DelegatingLocation, Location

VERIFY_REMOTE_THREADS = 16


def file_checksums(location: Location, record: CommitRecord) -> dict[str, str]:
    """Checksums of the non-array files of a checkpoint about to be committed.

    Read back from storage, so what is vouched for is what is there. Every object
    shard must exist; ``common.pt`` and ``metadata.json`` are listed when present.
    """
    sums = {}
    for rel in sorted(record.expected_files()):
        data = location.read_bytes_or_none(rel)
        if data is None:
            if rel.endswith(".pt") and rel != "common.pt":
                raise CheckpointingException(f"Sharded object file {location.describe(rel)} is missing at commit")
            continue
        sums[rel] = checksum(data)
    return sums


def checksum_mismatch(data: bytes, expected: str) -> str | None:
    """Why ``data`` does not match the checksum the commit record keeps for it, or None."""
    actual = checksum(data)
    return None if actual == expected else f"its checksum {actual} differs from {expected} in the commit record"


class ChecksummedLocation(DelegatingLocation):
    """A committed checkpoint's location: every read of a file the commit record could
    vouch for (common state, sharded objects, ``metadata.json``) is checked against
    the record, and such a file the record does not list is refused."""

    def __init__(self, inner: Location, record: CommitRecord) -> None:
        super().__init__(inner)
        self.record = record
        self._vouchable = record.expected_files()

    def read_bytes_or_none(self, rel: str, max_bytes: int | None = None) -> bytes | None:
        data = self.inner.read_bytes_or_none(rel, max_bytes)
        if data is None or rel not in self._vouchable:
            return data
        expected = self.record.files.get(rel)
        if expected is None and rel == CONFIG_FNAME:
            # Megatron-Core's own save (shardstore.megatron) writes metadata.json after the
            # commit. It only names the backends; the commit record stays the authority.
            return data
        if expected is None:
            raise CheckpointingException(
                f"{self.inner.describe(rel)} is not vouched for by the commit record of {self.inner.describe()} "
                "(added after the commit?); refusing to read it"
            )
        if why := checksum_mismatch(data, expected):
            raise CheckpointingException(
                f"Corrupt file {self.inner.describe(rel)}: {why}; restore it or load an earlier checkpoint"
            )
        return data


def open_committed(checkpoint: str | os.PathLike | Location) -> ChecksummedLocation:
    """The committed checkpoint at ``checkpoint``, its reads checked against its record
    (one already opened so is returned as it is: its record is not read again)."""
    location = open_location(checkpoint)
    if isinstance(location, ChecksummedLocation):
        return location
    return ChecksummedLocation(location, read_commit_record(location))


@dataclass(frozen=True)
class Problem:
    """One missing or corrupt object: ``key`` is the array key (or file path), ``part``
    the chunk key (``c.0.1``; ``c/0/1`` before format version 3) or ``"file"``."""

    key: str
    part: str
    message: str


@dataclass
class VerifyReport:
    """What ``verify`` found."""

    checkpoint: str
    problems: list[Problem] = field(default_factory=list)
    arrays_checked: int = 0
    chunks_checked: int = 0
    files_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        head = (
            f"checkpoint {self.checkpoint}: {self.arrays_checked} arrays, {self.chunks_checked} chunks, "
            f"{self.files_checked} files checked; "
        )
        if self.ok:
            return head + "no problems"
        lines = [f"  {p.key} [{p.part}]: {p.message}" for p in self.problems]
        return head + f"{len(self.problems)} problem(s):\n" + "\n".join(lines)

    def raise_if_damaged(self) -> None:
        if not self.ok:
            raise CheckpointingException(str(self))


def verify(checkpoint_dir: str | os.PathLike | Location, progress: bool = False) -> VerifyReport:
    """Checks every chunk of every array and every checksummed file of a checkpoint.

    Never raises for damage: the report lists it (``report.ok``, ``str(report)``,
    ``report.raise_if_damaged()``). ``progress``: a progress bar of the bytes checked,
    on standard error.
    """
    location = open_location(checkpoint_dir)
    with progress_shown(progress), operation("verify", location.describe()) as timing:
        report = _verify(location)
        timing.nbytes = report.bytes_checked
    return report


def _verify(location: Location) -> VerifyReport:
    report = VerifyReport(location.describe())
    try:
        record = read_commit_record(location)
    except CheckpointingException as exc:
        report.problems.append(Problem(COMMIT_RECORD, "file", str(exc)))
        return report
    for rel, expected in sorted(record.files.items()):
        report.files_checked += 1
        try:
            data = location.read_bytes_or_none(rel)
        except CheckpointingException as exc:
            report.problems.append(Problem(rel, "file", str(exc)))
            continue
        if data is None:
            report.problems.append(Problem(rel, "file", "missing"))
        elif why := checksum_mismatch(data, expected):
            report.problems.append(Problem(rel, "file", why))
    try:
        store = chunk_store_for(location, VERIFY_REMOTE_THREADS)
    except CheckpointingException as exc:
        report.problems.append(Problem("", "store", str(exc)))
        return report
    with tracked("verify", (a.nbytes for a in record.arrays.values())) as tick:
        for _, array in sorted(record.arrays.items()):
            report.arrays_checked += 1
            _verify_array(store, array, report, tick)
    return report


def _verify_array(store: ChunkStore, array: ArrayRecord, report: VerifyReport, tick: Tick | None) -> None:
    chunks = ArrayChunks.of(store, array)
    try:
        buffer = np.empty(array.chunk_shape, chunks.dtype)
    except MemoryError:
        report.problems.append(Problem(array.key, "all", f"chunk shape {array.chunk_shape} too large to check here"))
        return
    for index in array.chunk_indices():
        report.chunks_checked += 1
        try:
            chunks.file(index).read_into(buffer)
        except Exception as exc:  # every failure is a finding, reported by chunk
            report.problems.append(Problem(array.key, array.chunk_key(index), str(exc)))
            continue
        nbytes = array.chunk_nbytes(index)
        report.bytes_checked += nbytes
        if tick:
            tick(nbytes)
