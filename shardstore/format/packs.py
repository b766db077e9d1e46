"""Packs: many small arrays in one stored zip (feature ``packs``, issue 44.6).

A save with ``SaveOptions.pack_arrays_up_to`` puts each array of at most that many bytes
whose every chunk one rank writes (replicated and whole-on-one-rank arrays) into that
rank's pack, ``packs/<rank>-<n>.zip``, instead of a directory of its own. A pack is an
uncompressed (stored) zip that is one Zarr v3 hierarchy: ``zarr.json`` (the root group),
each intermediate group's ``zarr.json``, and each packed array's ``<key>/zarr.json``
(exactly ``ArrayRecord.zarr_metadata()``) and chunks ``<key>/c.<i>...``, laid out by its
codec (``[bytes, crc32c]``: the raw bytes, then their crc32c). zarr-python opens it
through ``zarr.storage.ZipStore`` and TensorStore through its ``zip`` kvstore, by key.

The commit record names each packed array's pack and the byte offset of each of its
chunks' stored bytes inside it (``ArrayRecord.pack``, ``chunk_offsets``), and lists every
pack with its size (``CommitRecord.packs``). shardstore reads a packed chunk as a ranged
read of its pack at its offset (``PackedChunks``), checked by its own trailer and by the
crc32c the record keeps, like any chunk; a load opens each pack it reads once and reads
neighbouring members with one ranged read (``pack_runs``, ``format.chunks.run_reads``); ``verify`` also checks that the zip's central
directory and each local header put each member exactly where the record says (``check_pack``), so plain
readers read the bytes shardstore checked.

The zip is written here, not by ``zipfile``: its members are laid out in one pass over
the encoded chunks (no copy of their bytes), each with the zip's CRC-32 taken by the
writer thread that encoded it (``PackCollector.put``; ISA-L's where ``isal`` is installed,
``zip_crc32``), and handed to the store's ``put``
as one object (a file, or one object store PUT). No zip64: a pack is started anew before
``PACK_BYTES`` or ``PACK_MEMBERS`` members.
"""

from __future__ import annotations

__all__ = [
    "PACK_BYTES",
    "PACK_MEMBERS",
    "PACK_RUN_BYTES",
    "PACK_RUN_GAP",
    "PackCollector",
    "PackedChunks",
    "Packing",
    "check_pack",
    "fits_one_pack",
    "pack_name",
    "pack_runs",
    "read_members",
    "write_pack",
    "write_packs",
    "zip_crc32",
]

import copy
import json
import math
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from shardstore.errors import CheckpointingException
from shardstore.format.features import PACKS_DIR
from shardstore.format.records import ZARR_JSON, ArrayRecord, group_metadata, parent_groups
from shardstore.stores.base import ChunkStore, RangeReader, StorageError, fill_views

try:  # ISA-L's CRC-32: the same value as zlib's, about 20x zlib 1.2's speed on 32 KiB chunks here
    from isal.isal_zlib import crc32 as zip_crc32
except ImportError:  # an environment installed before isal was a dependency: zlib's
    from zlib import crc32 as zip_crc32

# A pack is closed before it would pass either bound (the zip format's own limits without
# zip64 are 4 GiB and 65,535 members).
PACK_BYTES = 2**31
PACK_MEMBERS = 65_000

# A load reads the members it needs of one pack in runs (``pack_runs``): members at most
# ``PACK_RUN_GAP`` bytes apart (the next member's local header and name, an array's
# ``zarr.json``) are read with one ranged read of at most ``PACK_RUN_BYTES`` (a member
# larger than that alone), so a load reads at most ``PACK_RUN_GAP`` bytes it does not
# need between two members, and a reader thread holds one run's buffer at a time. 16 MiB
# (a size S3 serves ranged GETs of well): 404 packed 512 KiB blocks of 2 ranks load from
# the local S3 server with 21 requests in 1.05 s, against 61 in 2.53 s with 4 MiB runs
# (that server reads the whole object for every ranged GET) and 813 in 2.13 s unpacked.
PACK_RUN_BYTES = 16 << 20
PACK_RUN_GAP = 4096

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, before the name
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, before the name
_END = struct.Struct("<IHHHHIIH")  # end of central directory record
_LOCAL_SIG, _CENTRAL_SIG, _END_SIG = 0x04034B50, 0x02014B50, 0x06054B50
_VERSION = 20  # 2.0: what a stored member needs
_UTF8 = 0x0800  # general purpose flag bit 11: names are UTF-8
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, the earliest a zip holds: packs are byte-reproducible
_CRC_BYTES = 4


def pack_name(rank: int, number: int) -> str:
    """The relative path of rank ``rank``'s pack ``number`` of a save."""
    return f"{PACKS_DIR}/{rank}-{number}.zip"


@dataclass(frozen=True)
class Packing:
    """Which arrays a rank packs in one save (``execution.save.packed_keys``), and the
    rank, which names its packs."""

    keys: frozenset[str]
    rank: int


class _Member(NamedTuple):
    pieces: list[memoryview | bytes]
    size: int
    crc: int  # the zip's CRC-32 (zlib's), not the chunk's crc32c


class PackCollector(ChunkStore):
    """Where a save's packed chunks go while their writers encode them
    (``format.chunks.run_writes``): each chunk's pieces kept as they are (views of the
    staged data and the trailer), with their size and zip CRC-32, taken on the writer's
    thread; ``write_packs`` then lays them out. Reads are not served."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.members: dict[str, _Member] = {}
        self._lock = threading.Lock()

    def describe(self, rel: str) -> str:
        return f"{rel} (to be packed)"

    def put(self, rel: str, buffers: Iterable[memoryview]) -> None:
        pieces, crc, size = [], 0, 0
        for piece in buffers:
            pieces.append(piece)
            crc = zip_crc32(piece, crc)
            size += len(piece)
        with self._lock:
            self.members[rel] = _Member(pieces, size, crc)

    def get_into(self, rel: str, views: list[memoryview], tail: int) -> tuple[int, bytes] | None:
        raise NotImplementedError("a pack being written is not read")

    def get_range_into(self, rel: str, offset: int, views: list[memoryview]) -> None:
        raise NotImplementedError("a pack being written is not read")

    def get_suffix(self, rel: str, nbytes: int) -> tuple[bytes, int] | None:
        raise NotImplementedError("a pack being written is not read")


class _ZipBuilder:
    """One pack's bytes, member by member: local headers, the members' pieces, then
    the central directory and its end record."""

    def __init__(self) -> None:
        self.pieces: list[memoryview | bytes] = []
        self.central: list[bytes] = []
        self.size = 0

    @property
    def members(self) -> int:
        return len(self.central)

    def add(self, name: str, member: _Member) -> int:
        """Appends ``member`` as ``name``; returns the offset of its data."""
        encoded = name.encode()
        header = _LOCAL.pack(_LOCAL_SIG, _VERSION, _UTF8, 0, 0, _DOS_DATE, member.crc, member.size, member.size,
                             len(encoded), 0) + encoded
        self.central.append(_CENTRAL.pack(
            _CENTRAL_SIG, _VERSION, _VERSION, _UTF8, 0, 0, _DOS_DATE, member.crc, member.size, member.size,
            len(encoded), 0, 0, 0, 0, 0, self.size) + encoded)
        self.pieces.append(header)
        self.pieces.extend(member.pieces)
        data_at = self.size + len(header)
        self.size = data_at + member.size
        return data_at

    def finish(self) -> list[memoryview | bytes]:
        directory = b"".join(self.central)
        end = _END.pack(_END_SIG, 0, 0, self.members, self.members, len(directory), self.size, 0)
        self.size += len(directory) + len(end)
        return [*self.pieces, directory, end]


def _document(text: str) -> _Member:
    """A member holding a JSON document (compact, as the commit record spells it)."""
    data = text.encode()
    return _Member([data], len(data), zip_crc32(data))


_GROUP = json.dumps(group_metadata(), separators=(",", ":"))


def _array_bytes(record: ArrayRecord) -> int:
    """About what an array adds to a pack (its chunks, headers and document)."""
    return record.chunk_count * (math.prod(record.chunk_shape) * record.itemsize + 200) + 2048


def _array_members(record: ArrayRecord) -> int:
    """At most how many members an array adds to a pack: its chunks, its document and
    its groups' documents."""
    return record.chunk_count + 1 + record.key.count("/")


def fits_one_pack(record: ArrayRecord) -> bool:
    """Whether ``record``'s array fits a pack of its own, within ``PACK_BYTES`` and
    ``PACK_MEMBERS`` (the root's document besides): an array is never split between
    packs, so one that does not fit (many small chunks) stays a directory of its own."""
    return _array_bytes(record) <= PACK_BYTES and _array_members(record) <= PACK_MEMBERS - 1


def write_packs(
    store: ChunkStore, rank: int, records: dict[str, ArrayRecord], collector: PackCollector,
) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, int]]:
    """Lays the packed arrays ``records`` (their chunks encoded into ``collector``) out
    in packs ``packs/<rank>-<n>.zip`` and writes each as one object through ``store``;
    returns each array's pack and chunk offsets (C order over its grid), and each
    pack's size. An array is never split between packs."""
    placed: dict[str, tuple[str, tuple[int, ...]]] = {}
    sizes: dict[str, int] = {}
    batch: list[ArrayRecord] = []
    batch_bytes = batch_members = 0

    def flush() -> None:
        nonlocal batch, batch_bytes, batch_members
        if not batch:
            return
        name = pack_name(rank, len(sizes))
        offsets, sizes[name] = write_pack(store, name, batch, collector)
        placed.update({key: (name, chunk_offsets) for key, chunk_offsets in offsets.items()})
        batch, batch_bytes, batch_members = [], 0, 0

    for key in sorted(records):
        record = records[key]
        nbytes, members = _array_bytes(record), _array_members(record)
        if batch and (batch_bytes + nbytes > PACK_BYTES or batch_members + members > PACK_MEMBERS - 1):
            flush()
        batch.append(record)
        batch_bytes += nbytes
        batch_members += members
    flush()
    return placed, sizes


def write_pack(
    store: ChunkStore, name: str, records: Sequence[ArrayRecord], collector: PackCollector,
) -> tuple[dict[str, tuple[int, ...]], int]:
    """Writes the pack ``name`` holding ``records`` (their chunks' stored bytes in
    ``collector``) as one object through ``store``: the root's and the groups' documents,
    then the arrays' documents, then their chunks block-major (``_chunks_block_major``).
    Returns each array's chunk offsets (C order over its grid) and the pack's size."""
    zip_ = _ZipBuilder()
    group = _document(_GROUP)
    zip_.add(ZARR_JSON, group)
    for path in parent_groups([r.key for r in records]):
        zip_.add(f"{path}/{ZARR_JSON}", group)
    for record in records:
        # the document the commit record encodes too (``encoded_document``, kept): encoded once
        zip_.add(f"{record.key}/{ZARR_JSON}", _document(record.encoded_document))
    placed: dict[str, list[int]] = {record.key: [] for record in records}
    for _, record, index in _chunks_block_major(records):
        rel = f"{record.key}/{record.chunk_key(index)}"
        member = collector.members.get(rel)
        if member is None:
            raise CheckpointingException(f"Internal error: packed chunk {rel} was not written; please report it")
        placed[record.key].append(zip_.add(rel, member))
    offsets = {key: tuple(chunk_offsets) for key, chunk_offsets in placed.items()}
    pieces = zip_.finish()
    try:
        store.put(name, [memoryview(p) if isinstance(p, bytes) else p for p in pieces])
    except CheckpointingException:
        raise
    except Exception as exc:  # OSError locally (a full disk); TensorStore's ValueError for S3
        raise CheckpointingException(f"Writing pack {store.describe(name)} {_holding(records)} failed: {exc}") from exc
    return offsets, zip_.size


def _chunks_block_major(records: Sequence[ArrayRecord]) -> list[tuple[int, ArrayRecord, tuple[int, ...]]]:
    """The chunks of ``records`` in the order a pack lays them out: every array's first
    chunk, then every array's second, and so on (each array's in C order over its grid).
    A split array packed with a chunk per block (``planning.plans.packed``) has its
    blocks in rank order, so the blocks one rank loads again lie side by side and are
    read in runs (``pack_runs``), not with a ranged read each."""
    chunks = [(ordinal, record, index) for record in records for ordinal, index in enumerate(record.chunk_indices())]
    return sorted(chunks, key=lambda chunk: chunk[0])  # stable: the arrays' order within an ordinal


def _holding(records: Sequence[ArrayRecord], named: int = 5) -> str:
    """Which arrays a pack holds, as its write failure names them (the first ``named``)."""
    keys = ", ".join(repr(r.key) for r in records[:named])
    return f"(arrays {keys}{f' and {len(records) - named} more' if len(records) > named else ''})"


def read_members(store: ChunkStore, records: Sequence[ArrayRecord], into: PackCollector) -> None:
    """Reads the stored bytes of the packed ``records``' chunks from their pack (one
    opening of it; they share one) into ``into``, as a save's writers would have put
    them: ``write_pack`` then lays them out anew."""
    if not records:
        return
    with store.ranges_of(records[0].pack) as read:
        for record in records:
            stored = math.prod(record.chunk_shape) * record.itemsize + _CRC_BYTES
            for index, offset in zip(record.chunk_indices(), record.chunk_offsets or (), strict=True):
                data = bytearray(stored)
                read(offset, [memoryview(data)])
                into.put(f"{record.key}/{record.chunk_key(index)}", [memoryview(data)])


class PackedChunks(ChunkStore):
    """One packed array's chunks as a ``ChunkStore`` (``format.chunks.ArrayChunks.of``): each
    chunk's object is its member's bytes inside the pack, at the offset the record
    gives, of the length its codec stores (``[bytes, crc32c]``); every read is a ranged
    read of the pack through ``base``. A read never reaches past the member, so a
    member's length is told as a file's is (``ChunkStore.get_into``)."""

    tells_longer = True

    def __init__(self, base: ChunkStore, record: ArrayRecord) -> None:
        assert record.pack is not None and record.chunk_offsets is not None
        self.base, self.pack, self.threads = base, record.pack, base.threads
        self.request_bytes = base.request_bytes
        self.stored = math.prod(record.chunk_shape) * record.itemsize + _CRC_BYTES
        if record.chunk_count == 1:
            self.offsets = {f"{record.key}/{record.chunk_key(next(record.chunk_indices()))}": record.chunk_offsets[0]}
        else:
            self.offsets = {f"{record.key}/{record.chunk_key(index)}": offset
                            for index, offset in zip(record.chunk_indices(), record.chunk_offsets)}

    def describe(self, rel: str) -> str:
        return f"{self.base.describe(self.pack)}, member {rel}"

    def span(self, rel: str) -> tuple[int, int]:
        """Where member ``rel``'s stored bytes are in the pack: its offset and length."""
        return self._at(rel), self.stored

    def landed(self, start: int, data: memoryview) -> PackedChunks:
        """These chunks read from ``data``, the pack's bytes from ``start`` that one
        ranged read brought in (``format.chunks.run_reads``), not from the pack: checked
        as every read is (the codec's trailer, the record's crc32c); a member outside
        ``data`` is refused."""
        landed = copy.copy(self)
        landed.base = _Landed(self.base, self.pack, start, data)
        return landed

    def _at(self, rel: str) -> int:
        offset = self.offsets.get(rel)
        if offset is None:
            raise StorageError(f"{self.describe(rel)} is not in the pack's record")
        return offset

    def put(self, rel: str, buffers: Iterable[memoryview]) -> None:
        raise NotImplementedError("a committed pack is never written")

    def get_into(self, rel: str, views: list[memoryview], tail: int) -> tuple[int, bytes] | None:
        offset = self._at(rel)
        asked = sum(len(v) for v in views)
        if asked > self.stored:
            return None
        rest = bytearray(min(tail, self.stored - asked))
        try:
            self.base.get_range_into(self.pack, offset, [*views, memoryview(rest)])
        except StorageError as exc:
            raise CheckpointingException(f"Reading {self.describe(rel)} failed: {exc}") from exc
        return asked, bytes(rest)

    def get_range_into(self, rel: str, offset: int, views: list[memoryview]) -> None:
        total = sum(len(v) for v in views)
        if offset + total > self.stored:
            raise StorageError(f"{self.describe(rel)}: bytes [{offset}, {offset + total}) past its {self.stored}")
        self.base.get_range_into(self.pack, self._at(rel) + offset, views)

    def get_suffix(self, rel: str, nbytes: int) -> tuple[bytes, int] | None:
        n = min(nbytes, self.stored)
        buffer = bytearray(n)
        self.base.get_range_into(self.pack, self._at(rel) + self.stored - n, [memoryview(buffer)])
        return bytes(buffer), self.stored


class _Landed(ChunkStore):
    """Bytes ``[start, start + len(data))`` of ``pack`` (on ``base``) already read: the
    base ``PackedChunks.landed`` reads its members from."""

    def __init__(self, base: ChunkStore, pack: str, start: int, data: memoryview) -> None:
        self.base, self.pack, self.start, self.data = base, pack, start, data
        self.threads, self.request_bytes = base.threads, base.request_bytes

    def describe(self, rel: str) -> str:
        return self.base.describe(rel)

    def put(self, rel: str, buffers: Iterable[memoryview]) -> None:
        raise NotImplementedError("a committed pack is never written")

    def get_into(self, rel: str, views: list[memoryview], tail: int) -> tuple[int, bytes] | None:
        raise NotImplementedError("a packed chunk is read by its range (PackedChunks)")

    def get_range_into(self, rel: str, offset: int, views: list[memoryview]) -> None:
        total = sum(len(v) for v in views)
        at = offset - self.start
        if rel != self.pack or at < 0 or at + total > len(self.data):
            raise StorageError(
                f"Internal error: bytes [{offset}, {offset + total}) of {self.describe(rel)} were not read with "
                f"[{self.start}, {self.start + len(self.data)}) of {self.describe(self.pack)}; please report it"
            )
        fill_views(views, self.data[at : at + total], 0)

    def get_suffix(self, rel: str, nbytes: int) -> tuple[bytes, int] | None:
        raise NotImplementedError("a packed chunk is read by its range (PackedChunks)")


def pack_runs(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int, list[int]]]:
    """The ranged reads of one pack that cover ``spans`` (each an offset and a length):
    each ``(start, end, positions in spans)``, in the pack's order, joining spans at most
    ``PACK_RUN_GAP`` apart into runs of at most ``PACK_RUN_BYTES`` (a longer span alone)."""
    runs: list[tuple[int, int, list[int]]] = []
    for position in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        offset, length = spans[position]
        end = offset + length
        if runs:
            start, last, positions = runs[-1]
            if offset - last <= PACK_RUN_GAP and max(last, end) - start <= PACK_RUN_BYTES:
                runs[-1] = (start, max(last, end), positions)
                positions.append(position)
                continue
        runs.append((offset, end, [position]))
    return runs


_MAX_COMMENT = 65_535


class _Entry(NamedTuple):
    """One member as a pack's central directory lists it."""

    offset: int  # of its local header
    flags: int
    method: int
    crc: int
    csize: int
    usize: int


def _central_directory(store: ChunkStore, pack: str, size: int) -> dict[str, _Entry]:
    """The pack's members by name, from its central directory.

    Raises:
        CheckpointingException: no end record, a directory past the pack or not ending
            where the end record starts, a malformed entry, one name twice, or a
            directory of other entries than its end record counts.
    """
    got = store.get_suffix(pack, _END.size + _MAX_COMMENT)
    if got is None:
        raise CheckpointingException("missing")
    tail, found = got
    if found != size:
        raise CheckpointingException(f"{found} bytes, where the commit record gives {size}")
    at = _end_record_at(tail)
    _, disk, cd_disk, disk_entries, entries, cd_size, cd_offset, _ = _END.unpack_from(tail, at)
    if disk or cd_disk or disk_entries != entries or cd_offset + cd_size > size:
        raise CheckpointingException("a malformed zip end record (several disks, or a directory past the end)")
    if cd_offset + cd_size != size - len(tail) + at:
        # zipfile takes a gap there for bytes prepended to the zip and shifts every member by it
        raise CheckpointingException("the zip central directory does not end where its end record starts")
    directory = bytearray(cd_size)
    store.get_range_into(pack, cd_offset, [memoryview(directory)])
    members: dict[str, _Entry] = {}
    pos = 0
    for _ in range(entries):
        if pos + _CENTRAL.size > cd_size:
            raise CheckpointingException("a truncated zip central directory")
        fields = _CENTRAL.unpack_from(directory, pos)
        if fields[0] != _CENTRAL_SIG:
            raise CheckpointingException(f"a malformed zip central directory entry at {cd_offset + pos}")
        name_len, extra_len, comment_len = fields[10], fields[11], fields[12]
        start = pos + _CENTRAL.size
        name = bytes(directory[start : start + name_len]).decode("utf-8", "replace")
        if name in members:
            raise CheckpointingException(f"member {name} is in the zip central directory twice")
        members[name] = _Entry(fields[16], fields[3], fields[4], fields[7], fields[8], fields[9])
        pos = start + name_len + extra_len + comment_len
    if pos != cd_size:
        # zipfile reads entries up to the directory's size, not its count: it would see others
        raise CheckpointingException(f"the zip central directory holds {cd_size - pos} bytes past its {entries} entries")
    return members


def _end_record_at(tail: bytes) -> int:
    """Where the zip's end of central directory record starts in ``tail`` (the pack's
    last bytes): the last signature whose record's comment ends the pack exactly, as
    zipfile finds it; the signature's bytes found elsewhere (in a directory offset or
    size that spells them) are skipped.

    Raises:
        CheckpointingException: there is none: not a zip."""
    signature = struct.pack("<I", _END_SIG)
    at = tail.rfind(signature)
    while at >= 0:
        if len(tail) - at >= _END.size and _END.unpack_from(tail, at)[7] == len(tail) - at - _END.size:
            return at
        at = tail.rfind(signature, 0, at)
    raise CheckpointingException("no zip end of central directory record: not a zip")


def check_pack(
    store: ChunkStore, pack: str, size: int, arrays: list[ArrayRecord],
) -> list[tuple[str, str, str]]:
    """What is wrong with a pack as plain zip readers read it: its size, its members
    (exactly the root's, the groups' and the packed ``arrays``' documents and chunks),
    each member's place (every chunk's data exactly at the offset the record gives,
    so that plain readers read the bytes ``verify`` checks), its zip CRC-32 and, for
    the documents, their content. Returns ``(key, part, message)`` findings; the
    chunks' own bytes are checked as every chunk's are (``format.integrity``)."""
    try:
        members = _central_directory(store, pack, size)
    except (CheckpointingException, StorageError, OSError) as exc:
        return [(pack, "pack", str(exc))]
    problems: list[tuple[str, str, str]] = []
    expected: dict[str, tuple[str, str, int | None, bytes | None]] = {
        ZARR_JSON: (pack, ZARR_JSON, None, json.dumps(group_metadata()).encode())}
    for group in parent_groups([a.key for a in arrays]):
        expected[f"{group}/{ZARR_JSON}"] = (group, ZARR_JSON, None, json.dumps(group_metadata()).encode())
    for array in arrays:
        expected[f"{array.key}/{ZARR_JSON}"] = (array.key, ZARR_JSON, None, json.dumps(array.zarr_metadata()).encode())
        for index, offset in zip(array.chunk_indices(), array.chunk_offsets or ()):
            expected[f"{array.key}/{array.chunk_key(index)}"] = (array.key, array.chunk_key(index), offset, None)
    for name in sorted(members.keys() - expected.keys()):
        problems.append((pack, name, "a member of the pack that the commit record does not list"))
    try:
        with store.ranges_of(pack) as read:  # one opening for all its members' reads
            for name, (key, part, offset, document) in expected.items():
                entry = members.get(name)
                if entry is None:
                    problems.append((key, part, f"missing from {pack}'s zip directory: plain readers would not find it"))
                    continue
                if why := _member_problem(read, pack, size, name, entry, offset, document):
                    problems.append((key, part, why))
    except (StorageError, OSError) as exc:
        problems.append((pack, "pack", f"cannot be opened: {exc}"))
    return problems


def _member_problem(
    read: RangeReader, pack: str, size: int, name: str, entry: _Entry, offset: int | None, document: bytes | None,
) -> str | None:
    """Why one member of a pack (of ``size`` bytes) reads otherwise with plain readers
    than the record says (see ``check_pack``), or None. The member's bytes are read only
    where they lie inside the pack: its directory entry's sizes drive no allocation."""
    if entry.method != 0 or entry.csize != entry.usize or entry.flags & ~_UTF8:
        return f"member {name} of {pack} is not stored uncompressed, as shardstore writes it (method, flags or sizes)"
    encoded = name.encode()
    header = bytearray(_LOCAL.size + len(encoded))
    try:
        read(entry.offset, [memoryview(header)])
        fields = _LOCAL.unpack_from(header)
        data_at = entry.offset + _LOCAL.size + fields[9] + fields[10]
        if data_at + entry.usize > size:
            return f"member {name} of {pack}: its {entry.usize} bytes at {data_at} reach past the pack's {size} bytes"
        data = bytearray(entry.usize)
        read(data_at, [memoryview(data)])
    except (StorageError, OSError, struct.error) as exc:
        return f"member {name} of {pack} cannot be read: {exc}"
    if fields[0] != _LOCAL_SIG:
        return f"member {name} of {pack}: no local header at {entry.offset}"
    if why := _local_header_problem(fields, header[_LOCAL.size :], entry, encoded):
        return f"member {name} of {pack}: its local header {why} (plain zip readers refuse or misread it)"
    if offset is not None and data_at != offset:
        return (f"member {name} of {pack} starts at byte {data_at}, where the commit record says {offset}: plain "
                "readers would read other bytes than shardstore checks")
    if zip_crc32(data) != entry.crc:
        return f"member {name} of {pack}: its bytes do not match the zip's CRC-32 (plain zip readers refuse it)"
    if document is not None:
        try:
            same = json.loads(data) == json.loads(document)
        except (ValueError, RecursionError):
            same = False
        if not same:
            return f"member {name} of {pack} differs from the document the commit record implies"
    return None


def _local_header_problem(fields: tuple[int, ...], name: bytes, entry: _Entry, expected: bytes) -> str | None:
    """How a member's local header disagrees with its central directory entry (name,
    flags, method, CRC-32, sizes: zipfile refuses another name, TensorStore another
    flag or method), or None."""
    flags, method, crc, csize, usize, name_len = fields[2], fields[3], fields[6], fields[7], fields[8], fields[9]
    if name_len != len(expected) or bytes(name) != expected:
        return f"names {bytes(name[:name_len]).decode('utf-8', 'replace')!r}"
    if (flags, method) != (entry.flags, entry.method):
        return f"gives flags {flags:#x} and method {method}, its directory entry {entry.flags:#x} and {entry.method}"
    if (crc, csize, usize) != (entry.crc, entry.csize, entry.usize):
        return "gives another CRC-32 or size than its directory entry"
    return None
