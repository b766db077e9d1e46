"""The consolidated-only feature: the nodes' Zarr documents in the root's consolidated
metadata only (``ZarrMetadata.CONSOLIDATED_ONLY``, feature ``consolidated_only``).

A record using it names its ``zarr_metadata``; a reader then takes every array's and
group's document from the root's consolidated metadata (``CommitRecord.stored_documents``)
instead of looking for a ``zarr.json`` per node. Format version 6 introduced it (a
version 6 record always names it); from version 9 a record lists it in ``requires``
(``format.features``).

``documents_recipe`` is this feature's part of the plain readers' recipe
(``format.readers_recipe``): where an array of a directory of its own finds its document.
"""

from __future__ import annotations

__all__ = [
    "CONSOLIDATED_ONLY_FEATURE",
    "CONSOLIDATED_ONLY_SINCE",
    "ZarrMetadata",
    "documents_recipe",
    "zarr_metadata_from_json",
]

from enum import StrEnum
from typing import Any

from shardstore._zarr_autoload import EXTENSION_METADATA
from shardstore.errors import CheckpointingException

CONSOLIDATED_ONLY_FEATURE = "consolidated_only"
# The format version that introduced it, and that always names it.
CONSOLIDATED_ONLY_SINCE = 6


class ZarrMetadata(StrEnum):
    """Where a checkpoint keeps its Zarr nodes' metadata documents (``SaveOptions.zarr_metadata``).

    ``PER_NODE`` (the default): every array and group has its own ``zarr.json``, and the
    root's consolidated metadata repeats them; every Zarr reader opens any key by path.
    ``CONSOLIDATED_ONLY``: only the root's consolidated metadata holds them (feature
    ``consolidated_only``): one file fewer per array (one request fewer on object stores).
    zarr-python opens every key through ``zarr.open_group(checkpoint)``; TensorStore opens
    an array given its document from the root (``"metadata"`` with ``assume_metadata=True``);
    a reader that opens an array by its path alone finds nothing.
    """

    PER_NODE = "per_node"
    CONSOLIDATED_ONLY = "consolidated_only"


def zarr_metadata_from_json(raw: Any, version: int, where: str) -> ZarrMetadata:
    """The record's ``zarr_metadata`` ``raw``: absent (every node has its ``zarr.json``)
    or ``consolidated_only``, which a version 6 record always names. Whether the record's
    version or ``requires`` allows it is ``format.features``' check."""
    if raw is None and version != CONSOLIDATED_ONLY_SINCE:
        return ZarrMetadata.PER_NODE
    expected = ZarrMetadata.CONSOLIDATED_ONLY.value
    if raw != expected:
        raise CheckpointingException(
            f"{where}: malformed zarr_metadata {raw!r} in a version {version} commit record (version "
            f"{CONSOLIDATED_ONLY_SINCE} names {expected!r}, other versions nothing or that); restore the record "
            "from a copy"
        )
    return ZarrMetadata(raw)


def documents_recipe(where: ZarrMetadata, extension_listed: bool) -> list[dict[str, Any]]:
    """The plain readers' recipe for the arrays that have a directory of their own, one
    source per part of the root's consolidated metadata that lists them (``metadata``;
    ``EXTENSION_METADATA`` where ``extension_listed``): chunks under ``<checkpoint>/<key>/``,
    and each array's document in its own ``zarr.json`` (``PER_NODE``) or only in that
    listing (``CONSOLIDATED_ONLY``: ``"document": "listed"``)."""
    document = "zarr_json" if where is ZarrMetadata.PER_NODE else "listed"
    parts = ["metadata", *([EXTENSION_METADATA] if extension_listed else [])]
    return [{"listed_in": ["consolidated_metadata", part], "store": "directory", "document": document}
            for part in parts]
