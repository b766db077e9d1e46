"""The commit record (``CommitRecord``): what the root ``zarr.json`` vouches for, a
complete checkpoint; its JSON as written (``CommitRecord.to_json``,
``write_commit_record``), and read back and checked (``CommitRecord.from_json``).

The record binds every byte a reader uses: chunks are listed with their crc32c, the
other files (``common.pt``, objects, ``metadata.json``) with theirs, and every array's
and group's ``zarr.json`` and the consolidated metadata are derived from the record
(``CommitRecord.node_documents``), so ``verify`` compares them with what is stored. A
save may keep the nodes' documents in the consolidated metadata only
(``ZarrMetadata.CONSOLIDATED_ONLY``, feature ``consolidated_only``,
``CommitRecord.stored_documents``).

The root group's document (``to_root_metadata``) holds our record under
``attributes.shardstore``, the notes for plain readers, and Zarr consolidated metadata,
so that one read lists every array; its exact bytes are sealed from version 4
(``to_json``) and written atomically (``write_commit_record``). zarr-python parses every
document of the consolidated metadata when it opens the group, and without shardstore it
knows no bfloat16 or float8: one such array there made the whole checkpoint unreadable
to it, float32 arrays included. So the consolidated ``metadata`` lists the groups and
the arrays of Zarr's core data types only; the arrays of extension data types are listed
beside it, under ``EXTENSION_METADATA``, where plain zarr-python does not look and
shardstore's zarr plug-in (``shardstore._zarr_autoload``) finds them. Each array's own
``zarr.json`` names its data type as TensorStore writes it (``"bfloat16"``), for every
reader.

Everything read back is validated, field by field, before anything is built from it: a
malformed record gives a ``CheckpointingException`` that names the checkpoint, never a
crash or a huge allocation. A reader refuses a version it does not know
(``READABLE_FORMAT_VERSIONS``), a feature it does not know (by name), a record that uses
a feature it does not list (or, before 9, one newer than its version), and a record
whose own digest does not match its bytes (``encoding.seal_mismatch``).
"""

from __future__ import annotations

__all__ = [
    "MAX_RECORD_BYTES",
    "READABLE_FORMAT_VERSIONS",
    "CommitRecord",
    "group_metadata",
    "write_commit_record",
]

import functools
import json
import math
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from shardstore._zarr_autoload import EXTENSION_METADATA
from shardstore.errors import CheckpointingException
from shardstore.format.config import CONFIG_FNAME
from shardstore.format.dtypes import CORE_DATA_TYPES
from shardstore.format.features import (
    FORMAT_VERSION,
    PACKED_ARRAYS_ATTRIBUTE,
    UnsupportedFormatVersion,
    ZarrMetadata,
    allowed_by,
    check_uses,
    packs_from_json,
    required_by,
    zarr_metadata_from_json,
)
from shardstore.format.readers_attribute import READERS_ATTRIBUTE, readers_note
from shardstore.format.records.array_record import MAX_UNBOUND_CHUNKS, ArrayRecord
from shardstore.format.records.claim_document import is_claim, no_checkpoint_yet
from shardstore.format.records.encoding import (
    COMPACT_JSON,
    DIGEST_HEX_DIGITS,
    FILE_DIGESTS,
    FIRST_SEALED_VERSION,
    HEX_DIGITS,
    RECORD_DIGEST,
    UNSEALED_DIGEST,
    json_string,
    seal_mismatch,
    seal_record,
    splice,
)
from shardstore.format.records.names import (
    CHUNK_SEPARATOR,
    COMMIT_RECORD,
    COMMON_FILE,
    LEGACY_CHUNK_SEPARATOR,
    OBJECTS_DIR,
    RESERVED_ROOT_NAMES,
    ZARR_JSON,
    array_group_collisions,
    check_key,
    is_megatron_object_file,
    object_path,
    parent_groups,
)
from shardstore.format.records.record_parts import (
    ArrayPlaces,
    DcpMetadata,
    ObjectRecord,
    ReusedChunks,
)
from shardstore.stores.base import Location

# Largest commit record read (a crc32c per chunk: about 11 bytes each in JSON).
MAX_RECORD_BYTES = 2**30

# Versions this shardstore reads. Version 1 records carry no save id and no chunk
# checksums: their chunks are checked by their own crc32c only. Versions 1 and 2 name
# chunks ``c/1/0`` (a directory per axis but the last), version 3 ``c.1.0`` (files in
# the array's directory: one directory per tensor instead of two or three). Version 4
# adds the record's own digest (``record_digest``); earlier records have none. Versions
# 5 to 8 each introduced one feature, 9 (frozen) names them (``format.features``).
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9)


@functools.cache
def _library_version() -> str:
    """The installed shardstore's version (looked up once: the lookup reads the
    installation's metadata files, about 0.5 ms a save)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardstore")
    except PackageNotFoundError:
        return "unknown"


def group_metadata(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    """A group's ``zarr.json`` document."""
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


@dataclass(frozen=True)
class CommitRecord:
    """What the root ``zarr.json`` vouches for: a complete checkpoint.

    Attributes:
        arrays: every ShardedTensor key's array record.
        objects: every ShardedObject key with its shards' unique keys.
        world_size: ranks that saved it (informational).
        format_version: shardstore format version.
        library_version: shardstore version that wrote it.
        created: UNIX time of the commit, in seconds.
        files: checksum (``checksum()``) of every non-array file: the common state,
            sharded objects and ``metadata.json``, by relative path.
        save_id: the save that committed it (``shardstore.format.commit``); a save that
            replaces a checkpoint checks this id before it publishes.
        external_files: checksum of every file the caller of an in-place save wrote
            into the checkpoint before the commit (Megatron-Core's own ``save`` writes
            its sharded objects there itself), by relative path. shardstore reads only
            the ShardedObject shards among them (``object_shard_files``), checked like
            its own files; ``verify`` checks them all.
        reused_from: the earlier checkpoint whose chunks this save shared (hard links,
            clones or server-side copies) instead of writing them again, or None.
        beside: the top-level names another program had put into the checkpoint's
            directory when a save into a shared directory was published beside them
            (``format.commit``: ModelOpt's ``modelopt_state/`` in a Megatron-LM
            iteration). The save did not write them and the record does not vouch for
            them; ``verify`` names them as another program's instead of as damage, and
            a save replacing the checkpoint in a shared directory leaves them in place
            (``format.commit.ByRename``); any other replacing save refuses.
        dcp: what a save through DCP's API recorded of DCP's metadata, or None.
        places: where an import of model files found the arrays whose keys do not
            spell their places (``ArrayPlaces``), or None.
        file_digests: XXH3-128 (``file_digest``) of every file of ``files`` and
            ``external_files``, by relative path: a file is what the save wrote where
            both its crc32c and this digest match. Records written before it was added
            have none; their files are checked by their crc32c only.
        zarr_metadata: where the nodes' metadata documents are (``ZarrMetadata``):
            their own ``zarr.json`` files, or only the root's consolidated metadata
            (feature ``consolidated_only``, ``with_zarr_metadata``).
        packs: every pack of the checkpoint (``packs/<rank>-<n>.zip``, feature
            ``packs``) with its size in bytes; the arrays in them name theirs (``ArrayRecord.pack``).
        layout: the ``StorageLayout`` the save wrote by, as chosen (``to_json``), or
            None (records before it): informative, what a reader must understand is
            ``requires``.
    """

    arrays: dict[str, ArrayRecord]
    objects: dict[str, ObjectRecord] = field(default_factory=dict)
    world_size: int = 1
    format_version: int = FORMAT_VERSION
    library_version: str = field(default_factory=_library_version)
    created: float = field(default_factory=time.time)
    files: dict[str, str] = field(default_factory=dict)
    save_id: str = ""
    external_files: dict[str, str] = field(default_factory=dict)
    reused_from: ReusedChunks | None = None
    beside: tuple[str, ...] = ()
    dcp: DcpMetadata | None = None
    places: ArrayPlaces | None = None
    zarr_metadata: ZarrMetadata = ZarrMetadata.PER_NODE
    file_digests: dict[str, str] = field(default_factory=dict)
    packs: dict[str, int] = field(default_factory=dict)
    layout: dict[str, Any] | None = None

    def with_packs(self, packs: dict[str, int]) -> CommitRecord:
        """This record listing ``packs`` (name: size) of its packed arrays (feature ``packs``)."""
        return replace(self, packs=dict(packs)) if packs else self

    @functools.cached_property
    def requires(self) -> tuple[str, ...]:
        """The features a reader must understand to read this record (``format.features``)."""
        return required_by(self.arrays, self.zarr_metadata)

    @functools.cached_property
    def packed_arrays(self) -> dict[str, str]:
        """The packed arrays' keys, each with its pack (``ArrayRecord.pack``)."""
        return {k: a.pack for k, a in self.arrays.items() if a.pack is not None}

    def with_zarr_metadata(self, where: ZarrMetadata) -> CommitRecord:
        """This record with its nodes' documents kept ``where`` says (``CONSOLIDATED_ONLY``:
        feature ``consolidated_only``)."""
        where = ZarrMetadata(where)
        if where is ZarrMetadata.PER_NODE:
            if self.zarr_metadata is not ZarrMetadata.PER_NODE:
                raise CheckpointingException(
                    f"Internal error: a record whose documents are {self.zarr_metadata.value} cannot keep a document "
                    "per node; please report it"
                )
            return self
        return replace(self, zarr_metadata=where)

    def with_places(self, places: ArrayPlaces | None, where: str) -> CommitRecord:
        """This record with ``places`` (``SaveOptions.array_places``), which must name
        its arrays only: a record naming others would be refused by every reader."""
        if places is None:
            return self
        if unknown := sorted(places.paths.keys() - self.arrays.keys()):
            raise CheckpointingException(
                f"Internal error: the save {where} was given the place of {unknown[0]!r}, which is not one of its "
                "arrays; please report it"
            )
        return replace(self, places=places)

    @functools.cached_property
    def own_top_names(self) -> frozenset[str]:
        """The top-level names its save wrote or may have written (without listing every
        chunk, as ``vouched_paths`` does), the format's reserved names whether written or
        not. Computed once: ``refuses_beside`` asks for every name another program put
        beside, against every array's."""
        paths = (*self.arrays, *self.files, *self.external_files, *self.packs, COMMIT_RECORD, OBJECTS_DIR,
                 *RESERVED_ROOT_NAMES)
        return frozenset(rel.split("/", 1)[0] for rel in paths)

    def refuses_beside(self, name: str) -> str | None:
        """Why ``name`` cannot be one of the entries another program put beside this
        checkpoint (``beside``), or None: a path, a name of the format's or of this
        save's own (files under it would escape ``verify``), or an invalid key."""
        if "/" in name:
            return f"{name!r} is not a top-level name"
        if name in self.own_top_names or name.startswith(".shardstore"):
            return f"{name!r} is one of the checkpoint's own entries"
        try:
            check_key(name)
        except CheckpointingException as exc:
            return str(exc)
        return None

    def is_beside(self, rel: str) -> bool:
        """Whether ``rel`` lies under one of the names another program put beside the
        checkpoint (``beside``)."""
        return rel.split("/", 1)[0] in self.beside

    @functools.cached_property
    def object_shard_files(self) -> dict[str, str]:
        """Every ShardedObject shard the checkpoint holds, by unique key
        (``<key>/shard_<offset>_<shape>``): the relative path of its file. The save's
        own (``objects``) at ``object_path``; and those Megatron-Core's own ``save``
        wrote itself before an in-place save of ours (``tools.megatron_strategy``), at
        ``<unique key>.pt`` (its common strategy's layout), which the record lists among
        ``external_files`` and whose names are shards' unique keys."""
        files = {
            shard_key[: -len(".pt")]: shard_key
            for shard_key in self.external_files
            if is_megatron_object_file(shard_key)
        }
        files.update({k: object_path(k) for o in self.objects.values() for k in o.shard_keys})
        return files

    @functools.cached_property
    def object_keys(self) -> frozenset[str]:
        """The key of every ShardedObject the checkpoint holds a shard of (its own and
        those of ``object_shard_files``)."""
        return frozenset(shard_key.rsplit("/", 1)[0] for shard_key in self.object_shard_files)

    def expected_files(self) -> set[str]:
        """The non-array files a record may vouch for: nothing else, and nothing outside
        the checkpoint."""
        shard_keys = {k for o in self.objects.values() for k in o.shard_keys}
        return {CONFIG_FNAME, COMMON_FILE} | {object_path(k) for k in shard_keys}

    def node_documents(self) -> dict[str, dict[str, Any]]:
        """Every Zarr node's metadata document the record implies in the checkpoint's
        directory, by the relative path of its ``zarr.json`` (the root's excepted): each
        group's, and each array's but the packed ones' (their documents are in their
        packs, ``format.packs``). The consolidated metadata holds the same documents by
        node path, split in two (``consolidated_metadata``)."""
        return {f"{path}/{ZARR_JSON}": group_metadata() if array is None else array.zarr_metadata()
                for path, array in self._nodes()}

    def stored_documents(self) -> dict[str, dict[str, Any]]:
        """The node documents written as files of their own (``node_documents``), by
        relative path: all of them, or none when the record keeps them in the root's
        consolidated metadata only (``ZarrMetadata.CONSOLIDATED_ONLY``)."""
        return self.node_documents() if self.zarr_metadata is ZarrMetadata.PER_NODE else {}

    def consolidated_metadata(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """Zarr's consolidated metadata, every node's document by its path, in two parts:
        the groups and the arrays of core data types, which every zarr-python parses (its
        ``metadata``), and the arrays of extension data types (``EXTENSION_METADATA``
        beside it), which zarr-python without shardstore cannot parse and so must not
        find where it parses everything at once."""
        core: dict[str, dict[str, Any]] = {}
        extension: dict[str, dict[str, Any]] = {}
        for path, array in self._nodes():
            document = group_metadata() if array is None else array.zarr_metadata()
            (core if array is None or array.dtype in CORE_DATA_TYPES else extension)[path] = document
        return core, extension

    def _nodes(self) -> list[tuple[str, ArrayRecord | None]]:
        """Every node but the root by path, each array with its record (a group with
        None), in the order of the paths of their ``zarr.json`` (``node_documents``)."""
        nodes: dict[str, ArrayRecord | None] = dict.fromkeys(parent_groups(list(self.arrays)))
        nodes.update(self.arrays if not self.packs else {k: a for k, a in self.arrays.items() if a.pack is None})
        return sorted(nodes.items(), key=lambda node: f"{node[0]}/{ZARR_JSON}")

    def vouched_paths(self) -> set[str]:
        """Every file a committed checkpoint holds: the record, the files it lists, the
        node documents, every pack and every chunk outside them. Anything else was not
        written by its save."""
        paths = {COMMIT_RECORD, *self.files, *self.external_files, *self.stored_documents(), *self.packs}
        for key, array in self.arrays.items():
            if array.pack is not None:
                continue
            paths.update(f"{key}/{array.chunk_key(index)}" for index in array.chunk_indices())
        return paths

    def unlisted(self, found: list[str], own: Collection[str] = ()) -> list[str]:
        """The paths among ``found`` (every file under the checkpoint) that its save did
        not write, sorted: another program's, or added after the commit. Megatron-Core's
        own save writes ``metadata.json`` after the commit (it only names the backends),
        so that one is expected; so are ``own``, the markers proven to name this
        checkpoint's save (``own_markers``, which reads them). Before format 4 the record
        did not list what the caller of an in-place save wrote: there, only files a
        loader or plain reader would pick up are counted (``_reads_as_part``)."""
        unlisted = set(found) - self.vouched_paths() - {CONFIG_FNAME, *own}
        if self.format_version < FIRST_SEALED_VERSION:
            unlisted = {rel for rel in unlisted if self._reads_as_part(rel)}
        return sorted(unlisted)

    def _reads_as_part(self, rel: str) -> bool:
        """Whether a load or a plain reader would pick ``rel`` up: the common state, an
        object shard of ours, anything inside one of the record's arrays, a node document."""
        return (
            rel == COMMON_FILE
            or rel.startswith(f"{OBJECTS_DIR}/")
            or rel.rsplit("/", 1)[-1] == COMMIT_RECORD
            or any(rel.startswith(f"{key}/") for key in self.arrays)
        )

    def to_root_metadata(self) -> dict[str, Any]:
        """The root group's ``zarr.json``: our record plus Zarr consolidated metadata
        (from version 4, with the digest still unsealed: see ``to_json``)."""
        core, extension = self.consolidated_metadata()
        summaries = {k: a.to_summary() for k, a in sorted(self.arrays.items())}
        return self._root_metadata(summaries, core, extension, {k: d["data_type"] for k, d in extension.items()})

    def _root_metadata(self, summaries: Any, core: Any, extension: Any, extension_types: dict[str, str]) -> dict[str, Any]:
        """The root document of ``to_root_metadata``, given its arrays' summaries, the
        consolidated metadata's two parts and the extension arrays' data types."""
        sealed = {RECORD_DIGEST: UNSEALED_DIGEST} if self.format_version >= FIRST_SEALED_VERSION else {}
        attributes = {
            "shardstore": {
                **sealed,
                "format_version": self.format_version,
                "save_id": self.save_id,
                "library_version": self.library_version,
                "created": self.created,
                "world_size": self.world_size,
                "arrays": summaries,
                "objects": {k: list(o.shard_keys) for k, o in sorted(self.objects.items())},
                "files": dict(sorted(self.files.items())),
                **({"external_files": dict(sorted(self.external_files.items()))} if self.external_files else {}),
                **({FILE_DIGESTS: dict(sorted(self.file_digests.items()))} if self.file_digests else {}),
                **({"reused_from": self.reused_from.to_json()} if self.reused_from else {}),
                **({"beside": sorted(self.beside)} if self.beside else {}),
                **({"dcp": self.dcp.to_json()} if self.dcp else {}),
                **({"places": self.places.to_json()} if self.places is not None else {}),
                **({"zarr_metadata": self.zarr_metadata.value}
                   if self.zarr_metadata is not ZarrMetadata.PER_NODE else {}),
                **({"packs": dict(sorted(self.packs.items()))} if self.packs else {}),
                **({"layout": self.layout} if self.layout is not None else {}),
                **({"requires": list(self.requires)} if self.format_version >= FORMAT_VERSION else {}),
            }
        }
        if extension_types or self.packs or self.zarr_metadata is not ZarrMetadata.PER_NODE:
            packed = {k: a.dtype for k, a in self.arrays.items() if a.pack is not None} if self.packs else None
            attributes[READERS_ATTRIBUTE] = readers_note(extension_types, self.zarr_metadata, packed)
        if self.packs:
            attributes[PACKED_ARRAYS_ATTRIBUTE] = dict(sorted(self.packed_arrays.items()))
        root = group_metadata(attributes)
        root["consolidated_metadata"] = {
            "kind": "inline",
            "must_understand": False,
            "metadata": core,
            **({EXTENSION_METADATA: extension} if extension_types else {}),
        }
        return root

    def to_json(self) -> bytes:
        """The root ``zarr.json`` as written, sealed from version 4: ``to_root_metadata``
        as compact JSON, byte for byte, its arrays' parts from their records' encoded
        parts (``ArrayRecord.encoded_document``, ``encoded_summary``; ``encode_ahead``)."""
        groups = COMPACT_JSON.encode(group_metadata())
        parts: tuple[list[str], list[str]] = ([], [])  # the consolidated metadata's core, extension
        extension_types: dict[str, str] = {}
        for path, array in self._nodes():
            core = array is None or array.dtype in CORE_DATA_TYPES
            if not core:
                extension_types[path] = array.dtype  # type: ignore[union-attr]
            parts[not core].append(f"{json_string(path)}:{groups if array is None else array.encoded_document}")
        summaries = [f"{json_string(k)}:{a.encoded_summary()}" for k, a in sorted(self.arrays.items())]
        marker = f"\x00{uuid.uuid4().hex}"  # stands for each part in the document until spliced in
        root = self._root_metadata(f"{marker}a", f"{marker}c", f"{marker}e", extension_types)
        text = COMPACT_JSON.encode(root)
        for name, items in (("a", summaries), ("c", parts[0]), ("e", parts[1] if extension_types else None)):
            if items is not None:
                text = splice(text, json_string(f"{marker}{name}"), "{" + ",".join(items) + "}")
        data = text.encode()
        return seal_record(data) if self.format_version >= FIRST_SEALED_VERSION else data

    def encode_ahead(self) -> None:
        """Encodes every array's parts that binding its chunks leaves as they are
        (``ArrayRecord.encode_ahead``), kept by the records bound from these: a save
        runs it on the coordinator while its data is made durable, so that its commit
        encodes little more than the chunks' checksums."""
        for array in self.arrays.values():
            array.encode_ahead()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CommitRecord:
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
    def _parse(cls, data: bytes, where: str) -> CommitRecord:
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


def write_commit_record(location: Location, record: CommitRecord) -> None:
    """Writes the root ``zarr.json`` atomically: from now on the checkpoint exists."""
    location.write_atomic(COMMIT_RECORD, record.to_json())
