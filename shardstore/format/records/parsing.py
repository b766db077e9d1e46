"""The commit record read back (``RecordParsing``, a base of ``CommitRecord``:
``CommitRecord.from_json``): parsed and checked, field by field, before anything is
built from it.

Everything read back is validated here: a malformed record gives a
``CheckpointingException`` that names the checkpoint, never a crash or a huge
allocation. A reader refuses a version it does not know (``READABLE_FORMAT_VERSIONS``),
a feature it does not know (by name), a record that uses a feature it does not list
(or, before 9, one newer than its version), and a record whose own digest does not
match its bytes (``digests.seal_mismatch``).
"""

from __future__ import annotations

__all__ = [
    "READABLE_FORMAT_VERSIONS",
    "RecordParsing",
]

import json
import math
from dataclasses import replace
from typing import Any, Self

from shardstore.errors import CheckpointingException
from shardstore.format.consolidated import zarr_metadata_from_json
from shardstore.format.features import (
    UnsupportedFormatVersion,
    allowed_by,
    check_uses,
)
from shardstore.format.pack_listing import packs_from_json
from shardstore.format.records.array_places import ArrayPlaces
from shardstore.format.records.array_record import ArrayRecord
from shardstore.format.records.bounds import MAX_UNBOUND_CHUNKS
from shardstore.format.records.claim_document import is_claim, no_checkpoint_yet
from shardstore.format.records.dcp_metadata import DcpMetadata
from shardstore.format.records.digests import (
    DIGEST_HEX_DIGITS,
    FILE_DIGESTS,
    FIRST_SEALED_VERSION,
    HEX_DIGITS,
    RECORD_DIGEST,
    seal_mismatch,
)
from shardstore.format.records.keys import array_group_collisions, check_key
from shardstore.format.records.names import CHUNK_SEPARATOR, LEGACY_CHUNK_SEPARATOR
from shardstore.format.records.object_record import ObjectRecord
from shardstore.format.records.reused_chunks import ReusedChunks

# Versions this shardstore reads. Version 1 records carry no save id and no chunk
# checksums: their chunks are checked by their own crc32c only. Versions 1 and 2 name
# chunks ``c/1/0`` (a directory per axis but the last), version 3 ``c.1.0`` (files in
# the array's directory: one directory per tensor instead of two or three). Version 4
# adds the record's own digest (``record_digest``); earlier records have none. Versions
# 5 to 8 each introduced one feature, 9 (frozen) names them (``format.features``).
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9)


class RecordParsing:
    """How ``CommitRecord`` (``records.commit_record``) is read back from its JSON. A base
    of ``CommitRecord`` only, which it builds (``cls``) and whose checks of listed files
    and of entries beside (``expected_files``, ``refuses_beside``) it asks."""

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Self:
        """The record ``data`` encodes, checked (``where`` names it in errors).

        The record parsed last is kept with its exact bytes, compared in full: a caller
        that opens the same checkpoint once per tensor (the seed's ``_load_from_array``,
        ``verify`` after the CLI's version check) parses it once, where each parse of a
        10,000-array record takes a tenth of a second or more. Bytes that differ in any
        way are parsed anew, so a record replaced since is never answered from memory;
        the records are treated as immutable by every reader. Only a record of at most
        ``_REMEMBERED_RECORD_BYTES`` is kept: a larger one (an unsharded save at
        thousands of ranks: hundreds of MB) would stay in the process's memory after
        its load for good."""
        last = _LAST_PARSED[0]
        if last is not None and last[0] == data:
            return last[1]
        record = cls._parse(data, where)
        _LAST_PARSED[0] = (bytes(data), record) if len(data) <= _REMEMBERED_RECORD_BYTES else None
        return record

    @classmethod
    def _parse(cls, data: bytes, where: str) -> Self:
        if is_claim(data):
            raise CheckpointingException(no_checkpoint_yet(data, where.removesuffix("/zarr.json")))
        try:
            root = json.loads(data)
        except (ValueError, RecursionError) as exc:  # not JSON, or nested past the parser's depth
            raise CheckpointingException(f"{where}: the commit record is not valid JSON: {exc}") from exc
        attributes = root.get("attributes") if isinstance(root, dict) else None
        record = attributes.get("shardstore") if isinstance(attributes, dict) else None
        if not isinstance(record, dict):
            raise CheckpointingException(_not_a_record(root, where))
        version = record.get("format_version")
        if type(version) is not int:  # true == 1 and 4.0 == 4 in Python: no version
            raise CheckpointingException(
                f"{where}: checkpoint format version {version!r} is not an integer: the commit record is "
                "damaged or was edited; restore it from a copy, or load an earlier checkpoint"
            )
        if version not in READABLE_FORMAT_VERSIONS:
            raise UnsupportedFormatVersion(
                f"{where}: checkpoint format version {version!r} is not supported "
                f"(this shardstore reads versions {list(READABLE_FORMAT_VERSIONS)}); upgrade shardstore"
            )
        if version >= FIRST_SEALED_VERSION and (why := seal_mismatch(data, record.get(RECORD_DIGEST))):
            raise CheckpointingException(
                f"{where}: the commit record is damaged or was edited ({why}); restore it from a copy, "
                "or load an earlier checkpoint"
            )
        allowed = allowed_by(record.get("requires"), version, where)
        arrays_json = record.get("arrays")
        objects_json = record.get("objects", {})
        if not isinstance(arrays_json, dict) or not isinstance(objects_json, dict):
            raise CheckpointingException(f"{where}: 'arrays' and 'objects' must be JSON objects")
        arrays = {}
        for key, summary in arrays_json.items():
            check_key(key, where=where)
            separator = CHUNK_SEPARATOR if version >= 3 else LEGACY_CHUNK_SEPARATOR
            arrays[key] = ArrayRecord.from_summary(key, summary, where, bound=version >= 2, separator=separator)
        if clashes := array_group_collisions(list(arrays)):
            raise CheckpointingException(f"{where}: the record names clashing keys: {clashes[0]}")
        if version < 2:
            _check_unbound_chunks(arrays, where)
        objects = {}
        for key, shard_keys in objects_json.items():
            check_key(key, where=where)
            if not isinstance(shard_keys, list) or not all(isinstance(s, str) for s in shard_keys):
                raise CheckpointingException(f"{where}: shards of object {key!r} must be a list of strings")
            for shard_key in shard_keys:
                check_key(shard_key, where=where)
            objects[key] = ObjectRecord(key, tuple(shard_keys))
        world_size = record.get("world_size", 1)
        created = _created_of(record)
        save_id = record.get("save_id")
        if version >= 2 and (not isinstance(save_id, str) or not save_id.isalnum() or len(save_id) > 64):
            raise CheckpointingException(f"{where}: malformed save id {save_id!r}")
        result = cls(
            arrays=arrays,
            objects=objects,
            world_size=world_size if isinstance(world_size, int) else 1,
            format_version=version,
            library_version=str(record.get("library_version", "unknown")),
            created=created,
            save_id=save_id if version >= 2 else f"legacy{int(created)}",
        )
        files = record.get("files", {})
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise CheckpointingException(f"{where}: 'files' must map paths to checksums")
        unexpected = sorted(set(files) - result.expected_files())
        if unexpected:
            raise CheckpointingException(f"{where}: the record lists unexpected files {unexpected[:5]}")
        external = record.get("external_files", {})
        if not isinstance(external, dict) or not all(isinstance(v, str) for v in external.values()):
            raise CheckpointingException(f"{where}: 'external_files' must map paths to checksums")
        for path in external:
            check_key(path, where=where)
        reused_from = ReusedChunks.from_json(record.get("reused_from"), where)
        dcp = DcpMetadata.from_json(record.get("dcp"), where)
        places = ArrayPlaces.from_json(record.get("places"), arrays, where)
        digests = _file_digests_from_json(record.get(FILE_DIGESTS, {}), {*files, *external}, where)
        packs = packs_from_json(record.get("packs", {}), arrays, where)
        result = replace(result, files=dict(files), external_files=dict(external), reused_from=reused_from, dcp=dcp,
                         places=places, file_digests=digests, packs=packs)
        beside = record.get("beside", [])
        if not isinstance(beside, list) or not all(isinstance(n, str) for n in beside):
            raise CheckpointingException(f"{where}: 'beside' must be a list of top-level names")
        for name in beside:
            if why := result.refuses_beside(name):
                raise CheckpointingException(f"{where}: the record names {name!r} as another program's entry: {why}")
        zarr_metadata = zarr_metadata_from_json(record.get("zarr_metadata"), version, where)
        check_uses(arrays, zarr_metadata, allowed, version, where)
        layout = record.get("layout")
        if layout is not None and not isinstance(layout, dict):
            raise CheckpointingException(f"{where}: 'layout' must be an object")
        return replace(result, beside=tuple(beside), zarr_metadata=zarr_metadata, layout=layout)


_REMEMBERED_RECORD_BYTES = 16 * 2**20  # about 30,000 arrays of one chunk each
_LAST_PARSED: list[tuple[bytes, Any] | None] = [None]
"""``CommitRecord.from_json``'s one remembered record and its bytes (a one-slot list:
a single item assignment, which needs no lock between threads)."""


def _check_unbound_chunks(arrays: dict[str, ArrayRecord], where: str) -> None:
    """Refuses a version 1 record whose arrays hold more than ``MAX_UNBOUND_CHUNKS``
    chunks in all: it lists no checksum per chunk, so its size bounds none of the work
    per chunk that ``verify`` and a replacing save's listing of what it vouches for do."""
    total = sum(array.chunk_count for array in arrays.values())
    if total > MAX_UNBOUND_CHUNKS:
        raise CheckpointingException(
            f"{where}: a version 1 record naming an absurd number of chunks ({total} in all, more than the "
            f"{MAX_UNBOUND_CHUNKS} a record without chunk checksums may name); the commit record was edited or damaged"
        )


def _not_a_record(node: Any, where: str) -> str:
    """Why the Zarr metadata document ``node`` at ``where`` is no commit record: an
    array's (a checkpoint's array directory was named), or a group's without
    ``attributes.shardstore``."""
    if isinstance(node, dict) and node.get("node_type") == "array":
        return (
            f"{where} is a Zarr array's metadata, not a shardstore checkpoint's commit record: "
            "name the checkpoint directory that holds the array"
        )
    return f"{where} is a Zarr group but not a shardstore checkpoint (no attributes.shardstore)"


def _created_of(record: dict[str, Any]) -> float:
    """The record's ``created`` (informational): 0.0, unknown, where it is no number
    a finite float holds (an integer past a float's range, ``Infinity``, ``NaN``)."""
    created = record.get("created", 0.0)
    if not isinstance(created, (int, float)):
        return 0.0
    try:
        value = float(created)
    except OverflowError:  # an integer past a float's range
        return 0.0
    return value if math.isfinite(value) else 0.0


def _file_digests_from_json(raw: Any, listed: set[str], where: str) -> dict[str, str]:
    """A record's ``FILE_DIGESTS``: 32 hex digits for files it lists in ``files`` or
    ``external_files`` (``listed``)."""
    if not isinstance(raw, dict) or not all(
        isinstance(v, str) and len(v) == DIGEST_HEX_DIGITS and set(v) <= HEX_DIGITS for v in raw.values()
    ):
        raise CheckpointingException(f"{where}: '{FILE_DIGESTS}' must map paths to {DIGEST_HEX_DIGITS} hex digits")
    if unlisted := sorted(set(raw) - listed):
        raise CheckpointingException(f"{where}: '{FILE_DIGESTS}' names files the record does not list {unlisted[:5]}")
    return dict(raw)


