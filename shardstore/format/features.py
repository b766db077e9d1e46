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

Each feature's name, the test of whether a record uses it and the parsing of its part
of the record live beside the feature (``format.sharding``, ``format.consolidated``,
``format.pack_listing``); ``FEATURES`` is the one table that joins them.
"""

from __future__ import annotations

__all__ = [
    "FEATURES",
    "FORMAT_VERSION",
    "Feature",
    "UnsupportedFeature",
    "UnsupportedFormatVersion",
    "allowed_by",
    "check_uses",
    "required_by",
]

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.format.consolidated import (
    CONSOLIDATED_ONLY_FEATURE,
    CONSOLIDATED_ONLY_SINCE,
    ZarrMetadata,
)
from shardstore.format.pack_listing import PACKS_FEATURE, PACKS_SINCE, in_a_pack
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
