"""The codec seam (issue 43.3): a registry of chunk codecs, recognition of an array's
``codecs``, a clear error for codecs none recognizes, and a second codec that saves,
loads, verifies and shares chunks without any change to the chunk I/O or its callers."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import crc32c
import numpy as np
import pytest
import torch

from shardstore import CheckpointingException, ShardedTensor, load, save, verify
from shardstore.format import codecs
from shardstore.format.codecs import (
    BYTES_CRC32C,
    CODECS,
    CRC_BYTES,
    BytesCrc32c,
    ChunkCodec,
    ChunkSource,
    EncodedChunk,
    codec_for,
    register,
)
from shardstore.format.records import ArrayRecord, read_commit_record
from shardstore.stores.base import ChunkMismatch
from shardstore.stores.local import FileChunkStore
from shardstore.stores.locations import open_location
from tests.scenarios import rewrite_record

LITTLE = {"name": "bytes", "configuration": {"endian": "little"}}
CRC = {"name": "crc32c"}


def test_the_registry_names_bytes_and_crc32c_and_refuses_a_second_class_of_that_name() -> None:
    assert CODECS[BytesCrc32c.name] is BytesCrc32c

    class Impostor(BytesCrc32c):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register(Impostor)
    assert CODECS[BytesCrc32c.name] is BytesCrc32c


@pytest.mark.parametrize(("codecs_found", "itemsize"), [
    ([LITTLE, CRC], 4),
    ([LITTLE, {"name": "crc32c", "configuration": {}}], 2),
    ([{"name": "bytes"}, CRC], 1),  # no endian: allowed for one-byte types
    ([LITTLE, CRC], 1),
])
def test_bytes_and_crc32c_recognize_each_spelling_of_their_codecs(codecs_found: list, itemsize: int) -> None:
    assert codec_for(codecs_found, itemsize, "ckpt", "w") == BYTES_CRC32C


@pytest.mark.parametrize("codecs_found", [
    [{"name": "bytes", "configuration": {"endian": "big"}}, CRC],
    [{"name": "bytes"}, CRC],  # a multi-byte type must name its byte order
    [CRC, LITTLE],
    [LITTLE],
    [LITTLE, {"name": "zstd", "configuration": {"level": 3}}, CRC],
    [LITTLE, {"name": "crc32c", "configuration": "x"}],
    "bytes",
    None,
])
def test_bytes_and_crc32c_recognize_nothing_else(codecs_found: Any) -> None:
    assert BytesCrc32c.recognize(codecs_found, 4) is None


def test_the_zarr_json_names_the_codecs_of_the_record() -> None:
    assert ArrayRecord("w", (4,), "float32", (4,)).zarr_metadata()["codecs"] == [LITTLE, CRC]
    assert ArrayRecord("w", (4,), "uint8", (4,)).zarr_metadata()["codecs"] == [{"name": "bytes"}, CRC]


def test_bytes_and_crc32c_encode_the_raw_bytes_then_their_crc32c_from_the_callers_memory() -> None:
    data = memoryview(np.arange(1000, dtype=np.float32).view(np.uint8))
    encoded = BYTES_CRC32C.encode(data)
    assert encoded.pieces[0] is data  # no copy
    assert encoded.crc == crc32c.crc32c(data)
    assert b"".join(encoded.pieces) == bytes(data) + crc32c.crc32c(data).to_bytes(4, "little")


@dataclass
class _Chunk:
    """A ``ChunkSource``: one object of a file chunk store."""

    store: FileChunkStore
    rel: str = "w/c.0"

    def describe(self) -> str:
        return f"chunk c.0 of array 'w' ({self.store.describe(self.rel)})"


def test_a_chunk_written_through_the_interface_reads_back_and_its_damage_is_named(tmp_path: Path) -> None:
    chunk = _Chunk(FileChunkStore(tmp_path))
    data = np.arange(64, dtype=np.int16)
    encoded = BYTES_CRC32C.encode(memoryview(data.view(np.uint8)))
    chunk.store.put(chunk.rel, list(encoded.pieces))
    out = np.empty_like(data)
    assert BYTES_CRC32C.read_into(chunk, [memoryview(out.view(np.uint8))]) == encoded.crc
    assert np.array_equal(out, data)
    path = tmp_path / chunk.rel
    stored = bytearray(path.read_bytes())
    stored[5] ^= 1
    path.write_bytes(bytes(stored))
    with pytest.raises(CheckpointingException, match=r"Corrupt chunk c\.0 of array 'w'.*crc32c mismatch"):
        BYTES_CRC32C.read_into(chunk, [memoryview(out.view(np.uint8))])
    path.write_bytes(bytes(stored[:-1]))
    with pytest.raises(CheckpointingException, match="truncated or overwritten"):
        BYTES_CRC32C.read_into(chunk, [memoryview(out.view(np.uint8))])
    path.unlink()
    with pytest.raises(CheckpointingException, match=r"Missing chunk c\.0 of array 'w'"):
        BYTES_CRC32C.read_into(chunk, [memoryview(out.view(np.uint8))])


def test_a_held_chunk_is_proven_against_the_stored_object() -> None:
    data = memoryview(bytes(range(256)) * 16)
    held = BYTES_CRC32C.held(data, hashlib.md5(b"").hexdigest())  # any digest: only the crc and bytes matter here
    assert held.crc == crc32c.crc32c(data) and held.nbytes == len(data) + CRC_BYTES
    with pytest.raises(ChunkMismatch, match="does not hold the bytes being saved"):
        held.check([data, memoryview(held.trailer)], "the old chunk")  # the digest given is not data's


def test_an_array_whose_codecs_no_codec_reads_is_refused_naming_checkpoint_key_and_codecs(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    save({"w": ShardedTensor.from_rank_offsets("enc/w", torch.ones(4))}, ckpt)
    zstd = [LITTLE, {"name": "zstd", "configuration": {"level": 3}}, CRC]
    rewrite_record(ckpt, lambda root: root["attributes"]["shardstore"]["arrays"]["enc/w"].update(codecs=zstd))
    with pytest.raises(CheckpointingException) as caught:
        load({"w": ShardedTensor.from_rank_offsets("enc/w", torch.empty(4))}, ckpt)
    message = str(caught.value)
    assert str(ckpt) in message and "'enc/w'" in message and "zstd" in message and BytesCrc32c.name in message


# ----------------------------------------------------------------- a second codec


@dataclass(frozen=True)
class _HeldXor:
    """What a shared object of an ``XorCrc32c`` chunk must hold: compared byte by byte."""

    stored: bytes
    crc: int

    @property
    def nbytes(self) -> int:
        return len(self.stored)

    def holds(self, blocks: Iterable[memoryview]) -> bool:
        return b"".join(bytes(b) for b in blocks) == self.stored

    def check(self, blocks: Iterable[memoryview], source: str) -> None:
        if not self.holds(blocks):
            raise ChunkMismatch(f"{source} does not hold the bytes being saved")

    def md5_hex(self) -> str:
        return hashlib.md5(self.stored, usedforsecurity=False).hexdigest()


@dataclass(frozen=True)
class XorCrc32c(ChunkCodec):
    """A codec the tests register: every byte inverted, then a crc32c of the stored
    bytes (a stand-in for compression: the stored bytes are not the chunk's)."""

    name: ClassVar[str] = "test-xor+crc32c"
    XOR: ClassVar[dict[str, str]] = {"name": "shardstore.test.xor"}

    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        return [*BYTES_CRC32C.zarr_codecs(itemsize)[:1], self.XOR, CRC]

    @classmethod
    def recognize(cls, codecs_found: Sequence[Any], itemsize: int) -> XorCrc32c | None:
        return cls() if codecs_found == cls().zarr_codecs(itemsize) else None

    def encode(self, data: memoryview) -> EncodedChunk:
        stored = memoryview(np.bitwise_not(np.frombuffer(data, np.uint8)))
        crc = crc32c.crc32c(stored)
        return EncodedChunk((stored, memoryview(crc.to_bytes(CRC_BYTES, "little"))), crc)

    def read_into(self, chunk: ChunkSource, views: list[memoryview]) -> int:
        got = chunk.store.get_into(chunk.rel, views, CRC_BYTES + 1)
        if got is None or got[0] != sum(len(v) for v in views) or len(got[1]) != CRC_BYTES:
            raise CheckpointingException(f"Corrupt or missing {chunk.describe()}")
        crc = functools.reduce(lambda c, v: crc32c.crc32c(v, c), views, 0)
        if crc != int.from_bytes(got[1], "little"):
            raise CheckpointingException(f"Corrupt {chunk.describe()}: crc32c mismatch")
        for v in views:
            np.bitwise_not(np.frombuffer(v, np.uint8), out=np.frombuffer(v, np.uint8))
        return crc

    def held(self, data: memoryview, digest: str) -> _HeldXor:
        encoded = self.encode(data)
        return _HeldXor(b"".join(encoded.pieces), encoded.crc)


@pytest.fixture
def xor_codec(monkeypatch: pytest.MonkeyPatch) -> XorCrc32c:
    """``XorCrc32c`` registered, and chosen for every array a save plans (the one line
    a save option choosing a codec would set)."""
    import shardstore.planning.plans.array_storage as plans

    monkeypatch.setitem(CODECS, XorCrc32c.name, XorCrc32c)
    monkeypatch.setattr(plans, "ArrayRecord", functools.partial(ArrayRecord, codec=XorCrc32c()))
    return XorCrc32c()


def _state(value: float) -> dict[str, ShardedTensor]:
    return {
        "w": ShardedTensor.from_rank_offsets("enc/w", torch.full((6, 5), value)),
        "frozen": ShardedTensor.from_rank_offsets("frozen", torch.arange(40, dtype=torch.bfloat16)),
    }


def _empty() -> dict[str, ShardedTensor]:
    return {"w": ShardedTensor.from_rank_offsets("enc/w", torch.empty(6, 5)),
            "frozen": ShardedTensor.from_rank_offsets("frozen", torch.empty(40, dtype=torch.bfloat16))}


def test_a_registered_codec_saves_loads_verifies_and_shares_chunks(tmp_path: Path, xor_codec: XorCrc32c) -> None:
    save(_state(1.0), tmp_path / "s1")
    stored = (tmp_path / "s1" / "frozen" / "c.0").read_bytes()
    raw = torch.arange(40, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert stored[:-CRC_BYTES] == bytes(255 - b for b in raw)
    assert stored[-CRC_BYTES:] == crc32c.crc32c(stored[:-CRC_BYTES]).to_bytes(CRC_BYTES, "little")
    assert json.loads((tmp_path / "s1" / "frozen" / "zarr.json").read_bytes())["codecs"] == xor_codec.zarr_codecs(2)
    record = read_commit_record(open_location(tmp_path / "s1"))
    assert {a.codec for a in record.arrays.values()} == {xor_codec}  # read back from the record
    loaded = load(_empty(), tmp_path / "s1")
    assert torch.equal(loaded["w"], torch.full((6, 5), 1.0))
    assert torch.equal(loaded["frozen"], torch.arange(40, dtype=torch.bfloat16))
    assert verify(tmp_path / "s1").ok

    save(_state(2.0), tmp_path / "s2", reuse_from=tmp_path / "s1")
    reused = read_commit_record(open_location(tmp_path / "s2")).reused_from
    assert reused is not None and reused.chunks == 1  # "frozen" is shared, "w" changed
    assert torch.equal(load(_empty(), tmp_path / "s2")["w"], torch.full((6, 5), 2.0))
    assert verify(tmp_path / "s2").ok


def test_a_chunk_of_a_registered_codec_is_checked_on_load(tmp_path: Path, xor_codec: XorCrc32c) -> None:
    save(_state(1.0), tmp_path / "s1")
    path = tmp_path / "s1" / "enc" / "w" / "c.0.0"
    stored = bytearray(path.read_bytes())
    stored[3] ^= 1
    path.write_bytes(bytes(stored))
    with pytest.raises(CheckpointingException, match=r"Corrupt chunk c\.0\.0 of array 'enc/w'"):
        load(_empty(), tmp_path / "s1")
    assert not verify(tmp_path / "s1").ok


def test_without_its_codec_registered_the_array_is_refused(tmp_path: Path, xor_codec: XorCrc32c,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    save(_state(1.0), tmp_path / "s1")
    monkeypatch.delitem(codecs.CODECS, XorCrc32c.name)
    with pytest.raises(CheckpointingException, match="shardstore.test.xor"):
        load(_empty(), tmp_path / "s1")
