"""The commit record's writing (``RecordWriting``, a base of ``CommitRecord``): the root
group's document (``to_root_metadata``: our
record under ``attributes.shardstore``, the notes for plain readers, and Zarr
consolidated metadata, so that one read lists every array), its exact bytes, sealed
from version 4 (``to_json``), and their atomic write (``write_commit_record``).

zarr-python parses every document of the consolidated metadata when it opens the
group, and without shardstore it knows no bfloat16 or float8: one such array there made
the whole checkpoint unreadable to it, float32 arrays included. So the consolidated
``metadata`` lists the groups and the arrays of Zarr's core data types only; the arrays
of extension data types are listed beside it, under ``EXTENSION_METADATA``, where plain
zarr-python does not look and shardstore's zarr plug-in (``shardstore._zarr_autoload``)
finds them. Each array's own ``zarr.json`` names its data type as TensorStore writes it
(``"bfloat16"``), for every reader.
"""

from __future__ import annotations

__all__ = [
    "RecordWriting",
    "group_metadata",
        "write_commit_record",
]

import uuid
from typing import Any

from shardstore._zarr_autoload import EXTENSION_METADATA
from shardstore.format.consolidated import ZarrMetadata
from shardstore.format.dtypes import CORE_DATA_TYPES
from shardstore.format.features import FORMAT_VERSION
from shardstore.format.pack_listing import PACKED_ARRAYS_ATTRIBUTE
from shardstore.format.readers_attribute import READERS_ATTRIBUTE, readers_note
from shardstore.format.records.compact_json import COMPACT_JSON, json_string, splice
from shardstore.format.records.digests import (
    FILE_DIGESTS,
    FIRST_SEALED_VERSION,
    RECORD_DIGEST,
    UNSEALED_DIGEST,
    seal_record,
)
from shardstore.format.records.names import COMMIT_RECORD
from shardstore.stores.base import Location


def group_metadata(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    """A group's ``zarr.json`` document."""
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


class RecordWriting:
    """How ``CommitRecord`` (``records.commit_record``) writes itself: its root document
    and that document's exact bytes. A base of ``CommitRecord`` only, whose fields and
    node listing (``_nodes``, ``consolidated_metadata``) it reads."""

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


def write_commit_record(location: Location, record: RecordWriting) -> None:
    """Writes the root ``zarr.json`` atomically: from now on the checkpoint exists."""
    location.write_atomic(COMMIT_RECORD, record.to_json())
