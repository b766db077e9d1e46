"""Chunk codecs: how one chunk of an array is laid out in its stored object.

A ``ChunkCodec`` is an array's whole Zarr v3 codec chain as one step between a chunk's
decoded bytes (little-endian; C order, or the order the codec names, such as a
shard's inner-chunk-major one: ``format.sharding``) and the object at its chunk key (zarr-python
chains ``ArrayBytesCodec`` and ``BytesBytesCodec`` steps; shardstore takes the chain as a
unit, so that bytes move straight between a tensor's memory and the storage). It says:

- ``zarr_codecs``: its ``codecs`` entry of the array's ``zarr.json``;
- ``recognize``: whether an existing array's ``codecs`` are its own (a classmethod);
- ``encode``: the pieces written, in order (views of the chunk's memory wherever the
  layout allows, so a local write is one ``writev`` and no copy), and the crc32c the
  commit record keeps for the chunk;
- ``read_into``: fills the caller's views from the stored object, checks the object's
  own checksums and returns the crc32c to compare with the record's;
- ``held``: what an object shared from an earlier checkpoint must hold
  (``stores.base.ExpectedBytes``, ``format.reuse``), with that crc32c.

The caller takes each chunk's 128-bit digest over its decoded bytes, whatever the codec.

``CODECS`` lists the codecs by name; ``codec_for`` picks the one that recognizes an
array's ``codecs`` (from the commit record, or a ``zarr.json``) and refuses, naming the
checkpoint, the key and the codecs, an array none recognizes. ``BYTES_CRC32C`` (raw
little-endian bytes then their crc32c, ``[bytes, crc32c]``) is every array's codec today.

Adding a codec is one module with a ``ChunkCodec`` subclass and a ``register`` call:

- compression (``[bytes, zstd, crc32c]``): ``encode`` compresses into a buffer of its
  own and returns ``(compressed, trailer)`` with the crc32c of the compressed bytes;
  ``read_into`` reads the object into a buffer, checks the trailer, decompresses into
  the views; ``held`` compresses and returns an ``ExpectedBytes`` that compares a
  stored object with those pieces byte by byte.
- ``sharding_indexed`` (the array's chunk is a shard of inner chunks; index of
  ``(offset, nbytes)`` uint64 pairs plus its own crc32c, at the end as TensorStore
  writes it): ``encode`` returns, per inner chunk, its rows (views) and its crc32c
  trailer, then the index and its trailer, and reports the crc32c of the inner chunks'
  crc32c values and the index's (cheap, and it binds every inner chunk); ``read_into``
  checks each inner chunk and the index. Reading part of a shard (inner-chunk
  granularity) is ``read_boxes_into``, whose default is a whole-chunk read.

A record naming a codec other than ``BYTES_CRC32C`` needs a new format version (older
readers then refuse it by its version instead of misreading its chunks).
"""

from __future__ import annotations

__all__ = [
    "BYTES_CRC32C",
    "CODECS",
    "CRC_BYTES",
    "BoxRead",
    "BytesCrc32c",
    "ChunkCodec",
    "ChunkSource",
    "EncodedChunk",
    "HeldBytes",
    "HeldChunk",
    "StreamedChunk",
    "codec_for",
    "recognized",
    "register",
]

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import crc32c
import numpy as np
import xxhash

from shardstore.errors import CheckpointingException
from shardstore.stores.base import ChunkMismatch, ChunkStore, ExpectedBytes

CRC_BYTES = 4
# One box of a chunk to read (slices from the chunk's origin) and the array it fills.
BoxRead = tuple[tuple[slice, ...], np.ndarray]


class ChunkSource(Protocol):
    """One stored chunk, as a codec's read sees it: the storage, the object's key in
    it and how to name the chunk in an error (``format.chunks.ChunkFile``)."""

    store: ChunkStore
    rel: str

    def describe(self) -> str:
        """The chunk, its array and its path, for error messages."""


@dataclass(frozen=True)
class EncodedChunk:
    """A chunk as its object is stored.

    Attributes:
        pieces: the object's bytes, in order (views of the chunk's memory where the
            codec allows; written with one ``writev`` locally).
        crc: the crc32c the commit record keeps for the chunk (the codec says of what).
    """

    pieces: tuple[memoryview, ...]
    crc: int


@dataclass
class StreamedChunk:
    """A chunk's stored object as pieces made while they are written
    (``ChunkCodec.encode_stream``).

    Attributes:
        pieces: the object's bytes, in order.
        crc: the crc32c the commit record keeps for the chunk; known once every piece
            was taken (None before).
    """

    pieces: Iterator[memoryview]
    crc: int | None = None


class ChunkCodec(ABC):
    """How one chunk of an array is stored: the module docstring says what each method
    owes its callers. Instances are immutable and compare by value (they are part of
    ``format.records.ArrayRecord``)."""

    name: ClassVar[str]
    # Reads of the array's chunks go through ``read_boxes_into`` (all of one load's
    # boxes of a chunk at once), which reads less than the whole object or lays out
    # decoded bytes other than C order (else a reader of part of a chunk reads it whole
    # into its own buffer, or straight into its target).
    reads_spans: ClassVar[bool] = False

    @abstractmethod
    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        """The ``codecs`` of the array's ``zarr.json`` for elements of ``itemsize``
        bytes."""

    @classmethod
    @abstractmethod
    def recognize(cls, codecs: Sequence[Any], itemsize: int) -> ChunkCodec | None:
        """The codec these ``codecs`` (a ``zarr.json``'s, as parsed) describe, or None
        when they are not this class's."""

    @abstractmethod
    def encode(self, data: memoryview) -> EncodedChunk:
        """The stored object of a chunk whose decoded bytes are ``data``."""

    def encode_stream(self, data: memoryview, fold: Callable[[memoryview], None], block_bytes: int) -> StreamedChunk:
        """``encode`` as pieces made while they are taken: ``fold`` (the caller's
        digest) sees every byte of ``data`` once, in order, and a codec that can
        (``BytesCrc32c``) hands it each block of at most ``block_bytes`` as it takes
        its own checksum of it and just before the block is written, so all three
        passes find it in cache. This default folds the whole chunk, then encodes it."""
        fold(data)
        encoded = self.encode(data)
        return StreamedChunk(iter(encoded.pieces), encoded.crc)

    @abstractmethod
    def read_into(self, chunk: ChunkSource, views: list[memoryview]) -> int:
        """Fills ``views`` in order with the chunk's decoded bytes; returns the crc32c
        its ``encode`` reported.

        Raises:
            CheckpointingException: naming ``chunk.describe()``: the object is missing,
                or its length or its own checksums are wrong."""

    def stored_nbytes(self, nbytes: int) -> int | None:
        """The length of the object that stores a chunk of ``nbytes`` decoded bytes;
        None (the default) where it depends on the bytes (compression)."""
        return None

    @abstractmethod
    def held(self, data: memoryview, digest: str) -> HeldBytes:
        """What an object shared for a chunk of decoded bytes ``data`` (of 128-bit
        digest ``digest``) must hold, with the crc32c the record keeps for it."""

    def check_chunk_shape(self, chunk_shape: tuple[int, ...], where: str, key: str) -> None:
        """Refuses (CheckpointingException naming ``where`` and ``key``) an array of
        chunks of ``chunk_shape`` that this codec cannot lay out; every shape by default."""
        return None

    def read_boxes_into(self, chunk: ChunkSource, chunk_shape: tuple[int, ...], parts: Sequence[BoxRead]) -> int:
        """Fills each ``(box, out)`` of ``parts`` with that box (slices, from the chunk's
        origin) of a chunk of ``chunk_shape``, reading the object once; returns what
        ``read_into`` returns, checked as it checks. This default reads the whole chunk;
        a codec that can read part of its object (``format.sharding``: the inner chunks
        covering the boxes) reads less, and one whose decoded bytes are not the chunk's
        C order lays them out."""
        buffer = np.empty(chunk_shape, parts[0][1].dtype)
        crc = self.read_into(chunk, [memoryview(buffer.reshape(-1).view(np.uint8))])
        for box, out in parts:
            out[...] = buffer[box]
        return crc


class HeldBytes(ExpectedBytes, Protocol):
    """``stores.base.ExpectedBytes`` with the crc32c its chunk's codec reports."""

    crc: int


@dataclass(frozen=True)
class HeldChunk:
    """A chunk stored as its raw bytes then their crc32c, as the trainer handed them
    over: what a chunk shared with an earlier checkpoint must be proven to hold before
    the commit record binds it (``format.reuse``).

    Attributes:
        data: the chunk's raw bytes.
        crc: crc32c of ``data`` (the stored object is ``data`` then these 4 bytes).
        digest: XXH3-128 of ``data`` as 32 hex digits (``format.chunks.chunk_digest``).
        source_etag: the ETag the earlier checkpoint's record bound to the object
            being shared (``stores.base.ExpectedBytes.source_etag``), or None.
    """

    data: memoryview
    crc: int
    digest: str
    source_etag: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the stored object: the data and its crc32c."""
        return len(self.data) + CRC_BYTES

    @property
    def trailer(self) -> bytes:
        """The stored object's last bytes: the crc32c, little-endian."""
        return self.crc.to_bytes(CRC_BYTES, "little")

    def md5_hex(self) -> str:
        """MD5 of the stored object's bytes (what S3 reports as a single-part object's
        ETag); computed on each call, since only object stores need it."""
        md5 = hashlib.md5(self.data, usedforsecurity=False)
        md5.update(self.trailer)
        return md5.hexdigest()

    def holds(self, blocks: Iterable[memoryview]) -> bool:
        """Whether a stored object read as ``blocks`` (in order, possibly cut anywhere)
        is exactly this chunk: its length, the 128-bit digest of its data and its
        trailing crc32c. Stops reading once the object is longer than it should be."""
        hasher, size, at, tail = xxhash.xxh3_128(), len(self.data), 0, bytearray()
        for block in blocks:
            head = max(0, min(len(block), size - at))
            hasher.update(block[:head])
            tail += block[head:]
            at += len(block)
            if len(tail) > CRC_BYTES:
                return False
        return (at == self.nbytes and hasher.hexdigest() == self.digest
                and bytes(tail) == self.trailer)

    def check(self, blocks: Iterable[memoryview], source: str) -> None:
        """Raises ChunkMismatch, naming ``source``, unless ``holds(blocks)``."""
        if not self.holds(blocks):
            raise ChunkMismatch(
                f"{source} does not hold the bytes being saved (its length, 128-bit digest or crc32c differs: "
                "changed, replaced or damaged since its commit)"
            )


def _crc_trailer(crc: int) -> memoryview:
    return memoryview(crc.to_bytes(CRC_BYTES, "little"))


@dataclass(frozen=True)
class BytesCrc32c(ChunkCodec):
    """Zarr v3 ``[bytes (little-endian), crc32c]``: the chunk's raw bytes, then their
    crc32c, little-endian. The crc32c the record keeps is that trailer. Bit-identical
    to what TensorStore and zarr-python write for these codecs."""

    name: ClassVar[str] = "bytes+crc32c"

    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        bytes_codec: dict[str, Any] = {"name": "bytes"}
        if itemsize > 1:
            bytes_codec["configuration"] = {"endian": "little"}
        return [bytes_codec, {"name": "crc32c"}]

    @classmethod
    def recognize(cls, codecs: Sequence[Any], itemsize: int) -> BytesCrc32c | None:
        """Accepts ``bytes`` little-endian (or without an ``endian``, which the spec
        allows for one-byte types) followed by ``crc32c`` without options."""
        if not isinstance(codecs, Sequence) or len(codecs) != 2:
            return None
        array_bytes, checksum = codecs
        if not (_named(array_bytes, "bytes") and _named(checksum, "crc32c")) or _configuration(checksum) != {}:
            return None
        endian = _configuration(array_bytes)
        if endian == {"endian": "little"} or (itemsize == 1 and endian == {}):
            return cls()
        return None

    def encode(self, data: memoryview) -> EncodedChunk:
        crc = crc32c.crc32c(data)
        return EncodedChunk((data, _crc_trailer(crc)), crc)

    def encode_stream(self, data: memoryview, fold: Callable[[memoryview], None], block_bytes: int) -> StreamedChunk:
        """The data block by block (its crc32c and ``fold`` taken of each just before
        it is written), then the trailer."""
        streamed = StreamedChunk(iter(()))

        def pieces() -> Iterator[memoryview]:
            crc = 0
            for at in range(0, len(data), block_bytes):
                block = data[at : at + block_bytes]
                crc = crc32c.crc32c(block, crc)
                fold(block)
                yield block
            streamed.crc = crc
            yield _crc_trailer(crc)

        streamed.pieces = pieces()
        return streamed

    def stored_nbytes(self, nbytes: int) -> int:
        return nbytes + CRC_BYTES

    def read_into(self, chunk: ChunkSource, views: list[memoryview]) -> int:
        crc = 0

        def fold(block: memoryview) -> None:  # the crc32c of each block as it lands
            nonlocal crc
            crc = crc32c.crc32c(block, crc)

        got = chunk.store.get_into_folded(chunk.rel, views, CRC_BYTES + 1, fold)
        if got is None:
            raise CheckpointingException(f"Missing {chunk.describe()}: the checkpoint is damaged")
        n, trailer = got
        expected = sum(len(v) for v in views)
        if n != expected or len(trailer) != CRC_BYTES:
            raise CheckpointingException(
                f"Corrupt {chunk.describe()}: {n + len(trailer)} bytes, expected {expected + CRC_BYTES} "
                "(truncated or overwritten)"
            )
        if crc != int.from_bytes(trailer, "little"):
            raise CheckpointingException(f"Corrupt {chunk.describe()}: crc32c mismatch")
        return crc

    def held(self, data: memoryview, digest: str) -> HeldChunk:
        return HeldChunk(data, crc32c.crc32c(data), digest)


def _named(codec: Any, name: str) -> bool:
    return isinstance(codec, dict) and codec.get("name") == name


def _configuration(codec: dict[str, Any]) -> dict[str, Any] | None:
    """A codec entry's configuration ({} when absent; None when not an object)."""
    value = codec.get("configuration", {})
    return value if isinstance(value, dict) else None


BYTES_CRC32C = BytesCrc32c()
# Every codec shardstore reads, by name; ``codec_for`` asks each in this order.
CODECS: dict[str, type[ChunkCodec]] = {BytesCrc32c.name: BytesCrc32c}


def register(codec: type[ChunkCodec]) -> type[ChunkCodec]:
    """Adds a codec class to ``CODECS`` under its ``name`` (usable as a decorator).

    Raises:
        ValueError: another class is registered under that name."""
    if CODECS.setdefault(codec.name, codec) is not codec:
        raise ValueError(f"a chunk codec named {codec.name!r} is already registered ({CODECS[codec.name]!r})")
    return codec


def recognized(codecs: Any, itemsize: int) -> ChunkCodec | None:
    """The first registered codec that recognizes an array's ``codecs``, or None."""
    for codec in CODECS.values():
        if (found := codec.recognize(codecs, itemsize)) is not None:
            return found
    return None


def codec_for(codecs: Any, itemsize: int, where: str, key: str) -> ChunkCodec:
    """The registered codec that recognizes an array's ``codecs`` (``recognized``).

    Raises:
        CheckpointingException: naming ``where`` (the checkpoint), the array's ``key``
            and the codecs found, when no registered codec recognizes them."""
    if (found := recognized(codecs, itemsize)) is not None:
        return found
    raise CheckpointingException(
        f"{where}: array {key!r} is stored with codecs {codecs!r}, which no chunk codec of this shardstore "
        f"reads (it reads {', '.join(sorted(CODECS))}); read it with a shardstore that registers them, or with "
        "zarr-python or TensorStore"
    )
