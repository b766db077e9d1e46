"""The commit record's JSON: ``CommitRecord.to_json`` splices its arrays' parts, encoded
once per record (``encode_ahead``, which a save runs while its data is made durable),
into the document ``to_root_metadata`` describes; the bytes are the same either way."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardstore.errors import CheckpointingException
from shardstore.execution.save_commit import bind_chunks
from shardstore.format.chunks import WrittenChunk
from shardstore.format.features import FORMAT_VERSION, ZarrMetadata
from shardstore.format.records import (
    ArrayPlaces,
    ArrayRecord,
    CommitRecord,
    ObjectRecord,
    ReusedChunks,
)
from shardstore.format.records.encoding import seal_record
from shardstore.format.sharding import ShardingIndexed


def _record() -> CommitRecord:
    """Arrays of every kind the record encodes apart: nested keys whose groups sort
    between them (``a`` and ``a.b``), extension data types, a 0-d array, a flattened
    block, a sharded codec, a non-ASCII key."""
    arrays = {
        "a": ArrayRecord("a", (4, 6), "float32", (2, 6)),
        "a.b": ArrayRecord("a.b", (4,), "bfloat16", (4,)),
        "g/x": ArrayRecord("g/x", (3,), "int8", (3,), flattened_block=(3,)),
        "g.h/y": ArrayRecord("g.h/y", (), "complex64", ()),
        "\u00e9x": ArrayRecord("\u00e9x", (8,), "float8_e4m3fn", (8,)),
        "s": ArrayRecord("s", (64, 4), "float32", (32, 4), codec=ShardingIndexed((16, 4), 4)),
    }
    return CommitRecord(
        arrays, objects={"o": ObjectRecord("o", ("o/0",))}, files={"common.pt": "crc32c:00000001"}, save_id="abc",
        reused_from=ReusedChunks("elsewhere", "def", 1, 2), beside=("theirs",),
    )


def _reports(record: CommitRecord, etag_of: str = "s") -> list[list[WrittenChunk]]:
    return [[
        WrittenChunk(key, index, 7 + i, f"{i:032x}", etag="etag" if key == etag_of else None)
        for i, (key, array) in enumerate(record.arrays.items()) for index in array.chunk_indices()
    ]]


@pytest.mark.parametrize("where", list(ZarrMetadata))
@pytest.mark.parametrize("ahead", [False, True])
def test_the_record_is_the_compact_encoding_of_its_root_document(where: ZarrMetadata, ahead: bool) -> None:
    record = _record().with_zarr_metadata(where)
    if ahead:
        record.encode_ahead()
    bound = bind_chunks(record, _reports(record), "ckpt")
    expected = seal_record(json.dumps(bound.to_root_metadata(), separators=(",", ":")).encode())
    assert bound.to_json() == expected
    assert CommitRecord.from_json(bound.to_json(), "ckpt").arrays == bound.arrays


_PACKED = ("a", "a.b", "g/x")


def _packed(record: CommitRecord) -> CommitRecord:
    """``record`` with ``_PACKED``'s arrays in one pack (feature ``packs``)."""
    arrays = {
        key: a.with_pack("packs/0-0.zip", tuple(100 * (i + 1) for i in range(a.chunk_count))) if key in _PACKED else a
        for key, a in record.arrays.items()
    }
    return replace(record, arrays=arrays).with_packs({"packs/0-0.zip": 10_000})


@pytest.mark.parametrize("where", list(ZarrMetadata))
def test_a_record_with_packed_arrays_is_the_compact_encoding_of_its_root_document(where: ZarrMetadata) -> None:
    record = _record().with_zarr_metadata(where)
    packed = _packed(bind_chunks(record, _reports(record), "ckpt"))
    assert packed.format_version == FORMAT_VERSION and "packs" in packed.requires
    assert packed.to_json() == seal_record(json.dumps(packed.to_root_metadata(), separators=(",", ":")).encode())
    back = CommitRecord.from_json(packed.to_json(), "ckpt")
    assert (back.arrays, back.packs, back.format_version) == (packed.arrays, packed.packs, FORMAT_VERSION)
    core, extension = back.consolidated_metadata()
    assert not set(_PACKED) & (core.keys() | extension.keys())
    assert {"g", "g.h/y", "s"} <= core.keys() and "\u00e9x" in extension  # groups stay, unpacked arrays stay
    attributes = packed.to_root_metadata()["attributes"]
    assert attributes["packed_arrays"] == dict.fromkeys(_PACKED, "packs/0-0.zip")
    readers = attributes["readers"]
    assert "packed_arrays_note" in readers
    assert readers["arrays_needing_shardstore_or_tensorstore"] == {"\u00e9x": "float8_e4m3fn"}
    # a packed bfloat16 array opens from its pack in zarr-python only with shardstore installed: named too
    assert readers["packed_arrays_needing_shardstore_or_tensorstore"] == {"a.b": "bfloat16"}
    vouched = back.vouched_paths()
    assert "packs/0-0.zip" in vouched and "g/x/c.0" not in vouched and "g/x/zarr.json" not in vouched
    assert "s/c.0.0" in vouched


def test_binding_packed_reports_names_the_pack_and_each_chunks_offset() -> None:
    record = _record()
    reports = [[c._replace(packed=("packs/1-0.zip", 1000 + 10 * c.index[0], 5000)) if c.key == "a" else c
                for c in _reports(record)[0]]]
    bound = bind_chunks(record, reports, "ckpt")
    assert bound.arrays["a"].pack == "packs/1-0.zip" and bound.arrays["a"].chunk_offsets == (1000, 1010)
    assert bound.packs == {"packs/1-0.zip": 5000} and bound.requires == ("sharding_indexed", "packs")
    assert bound.arrays["s"].pack is None
    mixed = [[c._replace(packed=("packs/1-0.zip", 1000, 5000)) if c.key == "a" and c.index == (0, 0) else c
              for c in _reports(record)[0]]]
    with pytest.raises(CheckpointingException, match="a packed array is packed whole"):
        bind_chunks(record, mixed, "ckpt")


def test_an_unbound_record_encodes_as_its_root_document() -> None:
    record = _record()
    record.encode_ahead()
    assert record.to_json() == seal_record(json.dumps(record.to_root_metadata(), separators=(",", ":")).encode())


def test_encoded_parts_follow_the_record_they_were_encoded_from() -> None:
    """A record made anew (``dataclasses.replace``) with another shape is encoded anew;
    one bound from an encoded record keeps its parts, its checksums its own."""
    array = ArrayRecord("w", (4,), "float32", (4,))
    array.encode_ahead()
    wider = replace(array, shape=(8,), chunk_shape=(8,))
    assert json.loads(wider.encoded_document)["shape"] == [8]
    bound = array.with_reports({(0,): WrittenChunk("w", (0,), 5, "0" * 32)}, "ckpt")
    assert json.loads(bound.encoded_summary())["chunk_crc32c"] == [5]
    assert bound.encoded_document == array.encoded_document


def test_binding_sets_the_checksums_and_keeps_every_other_field() -> None:
    array = ArrayRecord("w", (4, 2), "float32", (2, 2), flattened_block=(4, 2))
    reports = {(i, 0): WrittenChunk("w", (i, 0), 10 + i, f"{i:032x}") for i in range(2)}
    bound = array.with_reports(reports, "ckpt")
    assert bound == replace(array, chunk_crcs=(10, 11), chunk_digests=(f"{0:032x}", f"{1:032x}"))
    assert bound.chunk_etags is None
    crcs, digests = {i: r.crc for i, r in reports.items()}, {i: r.digest for i, r in reports.items()}
    assert array.with_chunk_crcs(crcs, "ckpt", digests) == bound
    assert array.with_chunk_crcs(crcs, "ckpt").chunk_digests is None


@pytest.mark.parametrize("shape", [(0,), (0, 4), (4, 0)])
def test_an_array_without_chunks_binds_and_a_save_of_it_loads(shape: tuple[int, ...], tmp_path) -> None:
    """A zero-size array has no chunk and no report: bound as before the one-pass
    binding (no checksums), and a save of one commits and loads back."""
    import torch

    import shardstore

    array = ArrayRecord("w", shape, "float32", tuple(max(1, n) for n in shape))
    assert array.with_reports({}, "ckpt") == array.with_chunk_crcs({}, "ckpt", {})
    state = {"w": torch.zeros(shape), "b": torch.ones(3)}
    shardstore.save(state, tmp_path / "ckpt")
    loaded = shardstore.load({"w": torch.empty(shape), "b": torch.empty(3)}, tmp_path / "ckpt")
    assert loaded["w"].shape == shape and torch.equal(loaded["b"], state["b"])


def test_a_chunk_nobody_reported_is_named() -> None:
    record = CommitRecord({"w": ArrayRecord("w", (4,), "float32", (2,))})
    with pytest.raises(CheckpointingException, match=r"no rank wrote chunk\(s\) \[\(1,\)\] of array 'w'"):
        bind_chunks(record, [[WrittenChunk("w", (0,), 1, "0" * 32)]], "ckpt")


def test_a_chunk_reported_twice_is_refused() -> None:
    record = CommitRecord({"w": ArrayRecord("w", (4,), "float32", (4,))})
    twice = WrittenChunk("w", (0,), 1, "0" * 32)
    with pytest.raises(CheckpointingException, match="written twice"):
        bind_chunks(record, [[twice], [twice]], "ckpt")


def test_array_places_say_an_int_key_from_a_list_index_and_round_trip() -> None:
    """An import's ``places`` (``ArrayPlaces``): a list index is a JSON int, an int
    dict key ``{"int": n}``; a record without them has no ``places`` at all."""
    places = ArrayPlaces({"a": ("optim", "state", 0, "x"), "g/x": ("l", 1, -3)},
                         frozenset({("optim", "state"), ("l", 1)}))
    record = replace(_bound(), places=places)
    document = json.loads(record.to_json())["attributes"]["shardstore"]
    assert document["places"] == {"a": ["optim", "state", {"int": 0}, "x"], "g/x": ["l", 1, {"int": -3}]}
    assert CommitRecord.from_json(record.to_json(), "ckpt").places == places
    assert "places" not in json.loads(_bound().to_json())["attributes"]["shardstore"]


def _bound() -> CommitRecord:
    record = _record()
    return bind_chunks(record, _reports(record), "ckpt")


@pytest.mark.parametrize("places", [
    {"nope": ["a"]},  # not an array of the record
    {"a": []},
    {"a": ["l", -1]},  # a negative list index
    {"a": ["l", True]},
    {"a": ["l", {"int": 1.5}]},
    {"a": ["l", 0], "g/x": ["l", "k"]},  # a list and a dict at once
    {"a": ["l", 0], "g/x": ["l", {"int": 1}]},
    ["a"],
])
def test_malformed_array_places_are_refused_naming_the_record(places: object) -> None:
    document = _bound().to_root_metadata()
    document["attributes"]["shardstore"]["places"] = places
    with pytest.raises(CheckpointingException, match=r"ckpt: malformed 'places' in the commit record"):
        CommitRecord.from_json(seal_record(json.dumps(document, separators=(",", ":")).encode()), "ckpt")


def test_a_save_given_the_place_of_an_unknown_array_is_refused_before_its_commit() -> None:
    with pytest.raises(CheckpointingException, match=r"'nope', which is not one of its arrays"):
        _record().with_places(ArrayPlaces({"nope": ("x", 0)}), "ckpt")
