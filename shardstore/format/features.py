"""Features by name: what a reader must understand to read a checkpoint.

The commit record lists them, ``attributes.shardstore.requires`` (as Zarr v3's
``must_understand``): a writer names every feature its checkpoint uses and no other
(``required_by``); a reader refuses a record that requires a name it does not know,
naming it (``UnsupportedFeature``: a newer shardstore wrote the checkpoint, not damage),
and a record that uses a feature it does not list (damage: ``check_uses``).

The format version is frozen at ``FORMAT_VERSION`` (9), the first to list its features:
a new feature becomes a name in ``FEATURES``, never a new version. Before it, versions
5 to 8 each introduced one feature (``Feature.since``), and a record of such a version
may use every feature introduced up to its version (``allowed_by``).

``FEATURES`` is the one table that joins each feature's name, the test of whether a
record uses it and the parsing of its part of the record. Sharding's live beside its
codec (``format.sharding``); the record's parts of the two others are below.

**consolidated_only**: the nodes' Zarr documents in the root's consolidated metadata
only (``ZarrMetadata.CONSOLIDATED_ONLY``). A record using it names its
``zarr_metadata``; a reader then takes every array's and group's document from the
root's consolidated metadata (``CommitRecord.stored_documents``) instead of looking for a
``zarr.json`` per node. Format version 6 introduced it (a version 6 record always names
it); from version 9 a record lists it in ``requires``. ``documents_recipe`` is this
feature's part of the plain readers' recipe (``format.readers_attribute``): where an
array of a directory of its own finds its document.

**packs**, in the commit record: which packs a checkpoint has and which arrays are in
them. A record using it lists every pack, ``packs/<rank>-<n>.zip``, with its size in
bytes (``CommitRecord.packs``), and each packed array names its pack and the offsets of
its chunks' stored bytes inside it (``ArrayRecord.pack``, ``chunk_offsets``). A reader
reads a packed chunk as a ranged read of its pack; ``format.packs`` writes and checks
the zips themselves. Format version 8 introduced it; from version 9 a record lists it in
``requires``. The root group's attribute ``packed_arrays`` names each packed array's
pack for plain readers; ``packs_recipe`` is this feature's part of their recipe.
"""

from __future__ import annotations

__all__ = [
    "CONSOLIDATED_ONLY_FEATURE",
    "CONSOLIDATED_ONLY_SINCE",
    "FEATURES",
    "FORMAT_VERSION",
    "MAX_PACK_BYTES",
    "PACKED_ARRAYS_ATTRIBUTE",
    "PACKS_DIR",
    "PACKS_FEATURE",
    "PACKS_SINCE",
    "PACK_NAME",
    "Feature",
    "UnsupportedFeature",
    "UnsupportedFormatVersion",
    "ZarrMetadata",
    "allowed_by",
    "check_uses",
    "documents_recipe",
    "in_a_pack",
    "packs_from_json",
    "packs_recipe",
    "required_by",
    "zarr_metadata_from_json",
]

import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from shardstore._zarr_autoload import EXTENSION_METADATA
from shardstore.errors import CheckpointingException
from shardstore.format.sharding import (
    FLAT_SHARDS_FEATURE,
    FLAT_SHARDS_SINCE,
    SHARDING_FEATURE,
    SHARDING_SINCE,
    shards_span_blocks,
    stored_in_shards,
)

# The format version every save writes, frozen: new features go into ``FEATURES`` (and
# a record's ``requires``), never into the version.
FORMAT_VERSION = 9


class UnsupportedFormatVersion(CheckpointingException):
    """A commit record of a format version this shardstore cannot read (a newer
    shardstore wrote it): not damage, and nothing here can check it."""


class UnsupportedFeature(UnsupportedFormatVersion):
    """A commit record that requires a feature this shardstore does not know (a newer
    shardstore wrote it): not damage; upgrade shardstore to read it."""


@dataclass(frozen=True)
class Feature:
    """One feature a record may require (``FEATURES``).

    Attributes:
        name: as the record's ``requires`` lists it.
        since: the format version that introduced it; records of versions 5 to 8 name
            no features and may use each one introduced up to their version.
        array_uses: whether an array's record uses it (None: no array does alone).
        record_uses: whether the record's ``zarr_metadata`` uses it (None: it does not).
    """

    name: str
    since: int
    array_uses: Callable[[Any], bool] | None = None
    record_uses: Callable[[ZarrMetadata], bool] | None = None


# consolidated_only: the nodes' Zarr documents in the root's consolidated metadata only.
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


# packs: many small arrays in per-rank stored zips (``format.packs``).
PACKS_FEATURE = "packs"
# The format version that introduced it.
PACKS_SINCE = 8
# Where the packs live, and how they are named (``packs/<rank>-<n>.zip``).
PACKS_DIR = "packs"
PACK_NAME = re.compile(r"packs/(0|[1-9][0-9]{0,8})-(0|[1-9][0-9]{0,8})\.zip")
# The root group's attribute that lists the packed arrays by key, each with its pack.
PACKED_ARRAYS_ATTRIBUTE = "packed_arrays"
# The most bytes of a pack (``format.packs`` starts a new one well before: no zip64).
MAX_PACK_BYTES = 2**32 - 1


def in_a_pack(array: Any) -> bool:
    """Whether the ``ArrayRecord`` ``array`` is stored in a pack (uses feature ``packs``)."""
    return array.pack is not None


def packs_from_json(raw: Any, arrays: Mapping[str, Any], where: str) -> dict[str, int]:
    """The record's ``packs`` (name: size), checked: named as the format names them,
    sizes a zip without zip64 may have, every packed array's pack among them and each of
    its chunks' stored bytes inside it. Unused packs are refused too: no save writes one."""
    if not isinstance(raw, dict) or any(
        not isinstance(name, str) or not PACK_NAME.fullmatch(name) or type(size) is not int
        or not 0 < size <= MAX_PACK_BYTES for name, size in raw.items()
    ):
        raise CheckpointingException(
            f"{where}: 'packs' must map pack names (packs/<rank>-<n>.zip) to their sizes in bytes; the commit record "
            "was edited or damaged"
        )
    used = set()
    for key, array in arrays.items():
        if array.pack is None:
            continue
        size = raw.get(array.pack)
        if size is None:
            raise CheckpointingException(
                f"{where}: array {key!r} is in pack {array.pack!r}, which the record's 'packs' does not list; the "
                "commit record was edited or damaged"
            )
        used.add(array.pack)
        stored = math.prod(array.chunk_shape) * array.itemsize + 4  # [bytes, crc32c]
        if any(o + stored > size for o in array.chunk_offsets or ()):
            raise CheckpointingException(
                f"{where}: array {key!r} names chunk offsets past the end of pack {array.pack!r} ({size} bytes); the "
                "commit record was edited or damaged"
            )
    if unused := sorted(set(raw) - used):
        raise CheckpointingException(
            f"{where}: the record lists pack {unused[0]!r}, which no array is in; the commit record was edited or "
            "damaged"
        )
    return dict(raw)


def packs_recipe() -> dict[str, Any]:
    """The plain readers' recipe for packed arrays: listed, each with its pack's path
    relative to the checkpoint, in the root group's attribute ``packed_arrays``; a pack
    is a stored (uncompressed) zip that is a Zarr v3 hierarchy, the array at its key with
    its own ``zarr.json``."""
    return {"listed_in": ["attributes", PACKED_ARRAYS_ATTRIBUTE], "store": "zip_pack", "document": "zarr_json"}


FEATURES: tuple[Feature, ...] = (
    Feature(SHARDING_FEATURE, SHARDING_SINCE, array_uses=stored_in_shards),
    Feature(CONSOLIDATED_ONLY_FEATURE, CONSOLIDATED_ONLY_SINCE,
            record_uses=lambda where: where is ZarrMetadata.CONSOLIDATED_ONLY),
    Feature(FLAT_SHARDS_FEATURE, FLAT_SHARDS_SINCE, array_uses=shards_span_blocks),
    Feature(PACKS_FEATURE, PACKS_SINCE, array_uses=in_a_pack),
)


def required_by(arrays: Mapping[str, Any], zarr_metadata: ZarrMetadata) -> tuple[str, ...]:
    """The names of the features a record of ``arrays`` (``ArrayRecord`` by key) and
    ``zarr_metadata`` uses, in ``FEATURES`` order: what its ``requires`` lists."""
    return tuple(f.name for f in FEATURES if _user_of(f, arrays, zarr_metadata) is not None)


def allowed_by(requires: Any, version: int, where: str) -> frozenset[str]:
    """The features a record of ``version`` whose ``requires`` is ``requires`` (None where
    it has none) may use: every one introduced up to ``version`` before 9 (whatever it
    says in ``requires``), the ones it lists from 9.

    Raises:
        UnsupportedFeature: it requires a name this shardstore does not know.
        CheckpointingException: a malformed ``requires`` in a record of version 9.
    """
    if version < FORMAT_VERSION:  # read by its version: no writer of it wrote ``requires``
        return frozenset(f.name for f in FEATURES if f.since <= version)
    if not isinstance(requires, list) or not all(isinstance(n, str) for n in requires):
        raise CheckpointingException(
            f"{where}: the commit record's 'requires' must be a list of feature names, not {requires!r}; it was "
            "edited or damaged: restore it from a copy"
        )
    known = {f.name for f in FEATURES}
    if unknown := [name for name in requires if name not in known]:
        raise UnsupportedFeature(
            f"{where}: the checkpoint requires feature {unknown[0]!r}, which this shardstore does not know (it "
            f"knows {sorted(known)}): a newer shardstore wrote it; upgrade shardstore to read it"
        )
    return frozenset(requires)


def check_uses(arrays: Mapping[str, Any], zarr_metadata: ZarrMetadata, allowed: Collection[str], version: int,
               where: str) -> None:
    """Refuses a record that uses a feature outside ``allowed`` (``allowed_by``): no save
    wrote it so, and a reader that does not know the feature would misread it."""
    for feature in FEATURES:
        if feature.name not in allowed and (user := _user_of(feature, arrays, zarr_metadata)) is not None:
            claim = "does not list it in 'requires'" if version >= FORMAT_VERSION else f"claims version {version}"
            raise CheckpointingException(
                f"{where}: {user} uses feature {feature.name!r} (format version {feature.since} on), but the record "
                f"{claim}; the commit record was edited or damaged: restore it from a copy"
            )


def _user_of(feature: Feature, arrays: Mapping[str, Any], zarr_metadata: ZarrMetadata) -> str | None:
    """What of the record uses ``feature`` (the first array, or its Zarr documents), or None."""
    if feature.record_uses is not None and feature.record_uses(zarr_metadata):
        return f"its zarr_metadata {zarr_metadata.value!r}"
    if feature.array_uses is not None:
        for key, array in arrays.items():
            if feature.array_uses(array):
                return f"array {key!r}"
    return None
