"""Where a save puts its bytes, as one value: ``StorageLayout``.

Everything that decides which objects a checkpoint's bytes land in is a field here: the
largest chunk, the Zarr v3 shards that gather small blocks, which small arrays go into
zip packs, where the Zarr metadata documents go. Every door takes the layout whole
(``shardstore.save(layout=)``, ``SaveOptions.layout``, ``ShardstoreWriter(layout=)``,
``shardstore.megatron.install(layout=)``, the manager, ``CheckpointWriter``); their older
keywords (``shard_bytes=``, ``pack_arrays_up_to=``, ``zarr_metadata=``,
``max_chunk_bytes=``) are spellings of one, built by ``StorageLayout.of``.

A field left at ``AUTO`` is chosen by shardstore when the save begins
(``StorageLayout.chosen_for``) from what the save sees (``LayoutSite``: the number of
ranks, the kind of store, whether the ranks can exchange blocks); the choice is the
same on every rank, is kept in the commit record (``attributes.shardstore.layout``) and
is said on the save's INFO line. The rules and the measurements behind them:
docs/guide/layout.md.
"""

from __future__ import annotations

__all__ = [
    "AUTO", "AUTO_SHARD_MIN_RANKS", "DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_OBJECT_STORE_PACK_BYTES",
    "DEFAULT_PACK_BYTES", "DEFAULT_READ_GRAIN", "DEFAULT_SHARD_BYTES",
    "SHARD_SLACK", "LayoutSite", "StorageLayout",
]

import numbers
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from shardstore.format.features import ZarrMetadata
from shardstore.format.records import MAX_CHUNK_BYTES
from shardstore.stores.base import Capabilities

AUTO: Literal["auto"] = "auto"
"""A field's value that lets shardstore choose it (``StorageLayout.chosen_for``)."""

DEFAULT_MAX_CHUNK_BYTES = 64 * 2**20
"""The largest stored chunk by default: large enough to stream at disk speed, small
enough to keep a loader's reads near what it needs."""

DEFAULT_SHARD_BYTES = 64 * 2**20
"""The size of the Zarr v3 shards that gather small blocks, where shards are chosen: S3
recommends 8-16 MB per request, and a load at another layout reads whole inner chunks of
a shard, not whole shards, so a larger one costs it nothing."""

SHARD_SLACK = 1.25
"""A shard holds at most this many times ``shard_bytes`` of data (the planner's slack
to keep whole blocks together)."""

AUTO_SHARD_MIN_RANKS = 32
"""From this many ranks on, small blocks are gathered into shards by default: below it
the exchange costs more than the files it saves (a 2-rank Llama-shaped save with 64 MiB
shards took 2.8x as long), above it the files per block dominate a save."""

DEFAULT_PACK_BYTES = 256 * 1024
"""Arrays of at most this many bytes go into zip packs by default on a file system: a
file and its directory cost more than 256 KiB of bytes. 10,000 tensors of 1-64 KiB saved
2x faster packed, and 1,000 FSDP2 arrays of 128 KiB at 2 ranks through DCP's door 1.4x
(5 files, not 3,003)."""

DEFAULT_OBJECT_STORE_PACK_BYTES = 1 << 20
"""The same on an object store, where every object is a request, which costs about
as long as a MiB of bytes: 300 arrays of 128 KiB at 2 ranks saved 5.6x and loaded 4.3x
faster packed, and 404 arrays of 512 KiB saved 2.2x faster (15 requests, not 821) and
loaded as fast (docs/measurements/layout.md). A split array's blocks of 64 KiB or more
stay chunks of their own in the pack (``planning.plans.packed``), laid out so that one
rank's blocks are one ranged read (``format.packs``): a load reads no more than its
blocks. Smaller blocks are packed as one chunk, the whole array, which a loader reads
whole: a 300 KiB array split over 8 ranks costs each rank 300 KiB instead of its 37.5
KiB, inside the ranged reads it makes anyway, not a request per block."""

DEFAULT_READ_GRAIN = 1 << 20
"""The smallest piece a chunk is cut into for reads by default: a 2 -> 4 rank load of
first-axis blocks of 1-16 MiB read 2.0x what it loaded with whole chunks, 1.03x cut, and
a load at the saving layout reads a cut chunk in one pass as it reads a whole one; but a
load of 192 KiB blocks cut into 64 KiB took 1.5x as long as reading them whole (an
index read per chunk costs more than the bytes it saves): docs/measurements/
resharding.md. Chunks under twice it are read whole."""


@dataclass(frozen=True)
class LayoutSite:
    """What a save sees when its layout is chosen (``StorageLayout.chosen_for``).

    Attributes:
        world_size: ranks saving together.
        object_store: the target is an object store (S3): every object is a request.
        can_exchange: the ranks share a process group the save may send blocks on
            (False for a door without one, such as DCP's writer given no group, and for
            a save from one process): shards and arrays gathered whole for packing
            need it.
        callers_directory: the save writes into a directory its caller made and wrote
            into (Megatron-Core's ``save``, the seed's strategy API called directly): a
            ``zarr.json`` per array and no packs, as Megatron-Core's own readers expect.
    """

    world_size: int = 1
    object_store: bool = False
    can_exchange: bool = True
    callers_directory: bool = False

    @classmethod
    def of(
        cls, capabilities: Capabilities, world_size: int, can_exchange: bool = True, callers_directory: bool = False,
    ) -> LayoutSite:
        """The site of a save into a store with ``capabilities``: an object store is one
        the ranks share that is no local file system."""
        object_store = capabilities.shared_across_processes and not capabilities.is_local_filesystem
        return cls(world_size, object_store, can_exchange, callers_directory)


ShardBytes = int | None | Literal["auto"]

# The keywords whose None, at every door, means the caller did not give them.
_NONE_IS_NOT_GIVEN = frozenset({"pack_arrays_up_to", "zarr_metadata"})


@dataclass(frozen=True)
class StorageLayout:
    """Where a save puts its bytes; ``AUTO`` fields are chosen by shardstore.

    Attributes:
        max_chunk_bytes: the largest stored chunk, in bytes (``AUTO``: 64 MiB).
        shard_bytes: gather small blocks into Zarr v3 shards of about this many bytes;
            None: never; ``AUTO``: 64 MiB from ``AUTO_SHARD_MIN_RANKS`` ranks on, where
            the ranks can exchange blocks, else never.
        pack_arrays_up_to: put each array of at most this many bytes that one rank
            writes whole (gathered to it where it is split and the ranks can exchange)
            into that rank's zip pack (feature ``packs``); 0: never; ``AUTO``: 256 KiB
            on a file system, 1 MiB on an object store.
        zarr_metadata: where the Zarr metadata documents go (``ZarrMetadata``):
            ``"per_node"``, a ``zarr.json`` per array too; ``"consolidated_only"``, only
            the root's; ``AUTO``: consolidated only on an object store (a request per
            array saved), per node on a file system (any reader opens an array by path).
        read_grain: cut each chunk holding whole rows of a block split along its first
            axis into up to 8 inner chunks of at least this many bytes, one Zarr v3 shard
            per chunk (``planning.layout.read_grained_record``): a load at another layout reads the rows
            it needs, not whole chunks; None: never; ``AUTO``: ``DEFAULT_READ_GRAIN``
            (1 MiB) on every store (chunks under 2 MiB stay whole: docs/guide/layout.md).

    Raises:
        ValueError: a field outside what it takes, naming it.
    """

    max_chunk_bytes: int | Literal["auto"] = AUTO
    shard_bytes: ShardBytes = AUTO
    pack_arrays_up_to: int | Literal["auto"] = AUTO
    zarr_metadata: ZarrMetadata | Literal["auto"] = AUTO
    read_grain: int | None | Literal["auto"] = AUTO

    def __post_init__(self) -> None:
        _check_bytes("max_chunk_bytes", self.max_chunk_bytes, minimum=1, most=MAX_CHUNK_BYTES)
        if self.shard_bytes is not None:
            _check_bytes("shard_bytes", self.shard_bytes, minimum=1, none_means="never shard",
                         most=int(MAX_CHUNK_BYTES / SHARD_SLACK))
        _check_bytes("pack_arrays_up_to", self.pack_arrays_up_to, minimum=0)
        if self.read_grain is not None:
            _check_bytes("read_grain", self.read_grain, minimum=1, none_means="read whole chunks")
        if self.zarr_metadata != AUTO:
            try:  # a caller's string becomes the enum once, here; a typo fails before the save
                object.__setattr__(self, "zarr_metadata", ZarrMetadata(self.zarr_metadata))
            except ValueError:
                raise ValueError(
                    f"zarr_metadata must be one of ['auto', {', '.join(repr(m.value) for m in ZarrMetadata)}], "
                    f"got {self.zarr_metadata!r}"
                ) from None

    @classmethod
    def of(cls, layout: StorageLayout | None = None, **keywords: Any) -> StorageLayout:
        """``layout`` with the older keywords (``max_chunk_bytes``, ``shard_bytes``,
        ``pack_arrays_up_to``, ``zarr_metadata``) folded in: the one place a door's
        keywords become a layout. ``pack_arrays_up_to=None`` and ``zarr_metadata=None``
        (the doors' defaults) mean "not given"; ``shard_bytes=None`` means never shard
        (pass ``shard_bytes=AUTO`` to leave it).

        Raises:
            ValueError: a keyword that contradicts ``layout``, naming both."""
        given = {k: v for k, v in keywords.items() if not (v is None and k in _NONE_IS_NOT_GIVEN)}
        return (layout or cls()).combined(cls(**given))

    def combined(self, other: StorageLayout) -> StorageLayout:
        """The fields either layout sets (a field ``AUTO`` in one takes the other's).

        Raises:
            ValueError: both set a field to different values, naming the field."""
        merged = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != AUTO and theirs != AUTO and mine != theirs:
                raise ValueError(
                    f"The storage layout was given {f.name}={_spelled(mine)} and {f.name}={_spelled(theirs)}: "
                    "pass one of them"
                )
            merged[f.name] = theirs if mine == AUTO else mine
        return StorageLayout(**merged)

    @property
    def chosen(self) -> bool:
        """No field is ``AUTO``."""
        return all(getattr(self, f.name) != AUTO for f in fields(self))

    def chosen_for(self, site: LayoutSite) -> StorageLayout:
        """This layout with every ``AUTO`` field chosen for ``site`` (the rules in the
        fields' descriptions and ``LayoutSite``'s); fields set stay as they are. The one
        place a save's layout is chosen: nothing changes it afterwards. Deterministic:
        every rank given the same site chooses the same.

        Raises:
            ValueError: a caller's directory given packs or consolidated-only documents."""
        if site.callers_directory:
            return _CALLERS_DIRECTORY.combined(self).chosen_for(replace(site, callers_directory=False))
        choices: dict[str, Any] = {}
        if self.max_chunk_bytes == AUTO:
            choices["max_chunk_bytes"] = DEFAULT_MAX_CHUNK_BYTES
        if self.shard_bytes == AUTO:
            shards = site.can_exchange and site.world_size >= AUTO_SHARD_MIN_RANKS
            choices["shard_bytes"] = DEFAULT_SHARD_BYTES if shards else None
        if self.pack_arrays_up_to == AUTO:
            choices["pack_arrays_up_to"] = DEFAULT_OBJECT_STORE_PACK_BYTES if site.object_store else DEFAULT_PACK_BYTES
        if self.zarr_metadata == AUTO:
            choices["zarr_metadata"] = ZarrMetadata.CONSOLIDATED_ONLY if site.object_store else ZarrMetadata.PER_NODE
        if self.read_grain == AUTO:
            choices["read_grain"] = DEFAULT_READ_GRAIN
        return replace(self, **choices)

    def planned_at(self, site: LayoutSite) -> StorageLayout:
        """What a save's plan is made by at ``site`` (a strategy's ``plan_save`` takes
        it; the save itself keeps this chosen layout): the same, but where the ranks
        cannot exchange blocks, its ``pack_arrays_up_to`` is 0, so that no array split
        over ranks is gathered whole to one of them for its pack (arrays one rank holds
        whole are packed by this layout all the same)."""
        return self if site.can_exchange else replace(self, pack_arrays_up_to=0)

    def describe(self) -> str:
        """One line for a log: ``"chunks <= 64 MiB read in 1 MiB pieces, no shards,
        packs <= 256 KiB, metadata per_node"``."""
        grain = " read whole" if self.read_grain is None else f" read in {_spelled(self.read_grain)} pieces"
        shards = "no shards" if self.shard_bytes is None else f"shards ~{_spelled(self.shard_bytes)}"
        packs = "no packs" if self.pack_arrays_up_to == 0 else f"packs <= {_spelled(self.pack_arrays_up_to)}"
        metadata = self.zarr_metadata if self.zarr_metadata == AUTO else ZarrMetadata(self.zarr_metadata).value
        return f"chunks <= {_spelled(self.max_chunk_bytes)}{grain}, {shards}, {packs}, metadata {metadata}"

    def to_json(self) -> dict[str, Any]:
        """The layout as the commit record keeps it (``attributes.shardstore.layout``)."""
        return {f.name: _json_value(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> StorageLayout:
        """A layout ``to_json`` wrote; names this version does not know are ignored (the
        record is informative: what a reader must understand is ``requires``)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in document.items() if k in known})


def _check_bytes(name: str, value: object, *, minimum: int, none_means: str = "", most: int | None = None) -> None:
    """Refuses a size field outside ``[minimum, most]`` (``most``: the largest value whose
    chunks or shards readers accept, ``MAX_CHUNK_BYTES`` of data in one: a save would
    commit a checkpoint that no load can read)."""
    if value == AUTO:
        return
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum):
        never = f", None ({none_means})" if none_means else ""
        amount = "a positive number of bytes" if minimum == 1 else f"a number of bytes >= {minimum}"
        raise ValueError(f"{name} must be 'auto' (shardstore chooses){never} or {amount}, got {value!r}")
    if most is not None and value > most:
        raise ValueError(
            f"{name}={value} allows chunks or shards of more than the {MAX_CHUNK_BYTES} bytes readers accept in "
            f"one (a save would commit a checkpoint that no load can read): pass a {name} of at most {most}"
        )


def _json_value(value: Any) -> Any:
    return value.value if isinstance(value, ZarrMetadata) else value


def _spelled(value: Any) -> str:
    """A size as a person reads it (``64 MiB``); other values as they are."""
    if isinstance(value, bool) or not isinstance(value, int):
        return str(_json_value(value))
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size and value % size == 0:
            return f"{value // size} {unit}"
    return f"{value} B"


# What a save into a directory its caller made sets (``LayoutSite.callers_directory``).
_CALLERS_DIRECTORY = StorageLayout(pack_arrays_up_to=0, zarr_metadata=ZarrMetadata.PER_NODE)
