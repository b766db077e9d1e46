"""The commit record (``CommitRecord``): what the root ``zarr.json`` vouches for, a
complete checkpoint.

The record binds every byte a reader uses: chunks are listed with their crc32c, the
other files (``common.pt``, objects, ``metadata.json``) with theirs, and every array's
and group's ``zarr.json`` and the consolidated metadata are derived from the record
(``CommitRecord.node_documents``), so ``verify`` compares them with what is stored. A
save may keep the nodes' documents in the consolidated metadata only
(``ZarrMetadata.CONSOLIDATED_ONLY``, feature ``consolidated_only``,
``CommitRecord.stored_documents``). Its JSON is written by ``records.writing`` and parsed
and checked by ``records.parsing``.
"""

from __future__ import annotations

__all__ = [
    "CommitRecord",
]

import functools
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.format.config import CONFIG_FNAME
from shardstore.format.consolidated import ZarrMetadata
from shardstore.format.dtypes import CORE_DATA_TYPES
from shardstore.format.features import (
    FORMAT_VERSION,
    required_by,
)
from shardstore.format.records.array_places import ArrayPlaces
from shardstore.format.records.array_record import ArrayRecord
from shardstore.format.records.dcp_metadata import DcpMetadata
from shardstore.format.records.digests import FIRST_SEALED_VERSION
from shardstore.format.records.keys import RESERVED_ROOT_NAMES, check_key, parent_groups
from shardstore.format.records.names import (
    COMMIT_RECORD,
    COMMON_FILE,
    OBJECTS_DIR,
    ZARR_JSON,
    is_megatron_object_file,
    object_path,
)
from shardstore.format.records.object_record import ObjectRecord
from shardstore.format.records.parsing import RecordParsing
from shardstore.format.records.reused_chunks import ReusedChunks
from shardstore.format.records.writing import RecordWriting, group_metadata


@functools.cache
def _library_version() -> str:
    """The installed shardstore's version (looked up once: the lookup reads the
    installation's metadata files, about 0.5 ms a save)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardstore")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class CommitRecord(RecordWriting, RecordParsing):
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
