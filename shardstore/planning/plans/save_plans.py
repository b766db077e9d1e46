"""The coordinator's save plan (``plan_save``): a loop that places each array by its
kind and hands its writes to the ranks' parts (``RankPart``, one per rank):

    blocks       unsharded chunks, or shards inside blocks (``in_block``): written by
                 their holders, as the main shards say
    packed       a small array split over ranks, gathered whole to one writer (``packed``)
    gathered     shards across blocks, each gathered to one writer (``gathered``)
    flattened    flattened ranges' chunks, direct or assembled (``flat``)

What is assembled by exchange goes to its writer and to each contributor, numbered with
a tag unique within the save, at its place in the writer's assembly (``FlatChunk.at``,
which ``waves.exchange_waves`` cuts into waves).
"""

from __future__ import annotations

__all__ = ["RankPart", "plan_save"]

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from shardstore.format.records import ArrayRecord, CommitRecord, ObjectRecord, parent_groups
from shardstore.planning.layout import (
    DirectFlatWrite,
    FlatChunk,
    GatheredShards,
    ShardRecord,
    balance_writers,
)
from shardstore.planning.plans.array_storage import array_records
from shardstore.planning.plans.flat import plan_flat_writes
from shardstore.planning.plans.gathered import plan_gathered_writes
from shardstore.planning.plans.packed import plan_packed_whole
from shardstore.planning.plans.rank_plans import RankSavePlan


@dataclass
class RankPart:
    """One rank's part of a save while ``plan_save`` places the arrays: the lists its
    ``RankSavePlan`` freezes, each grown by its ``add_*`` (``shards``, by ``plan_save``).

    Attributes:
        shards: its main shards.
        direct: chunks inside one of its flattened ranges, written directly.
        straddling: ``(tag, chunk)`` it assembles or sends a piece of.
        metadata: arrays whose ``zarr.json`` it writes.
        touched: arrays it writes chunks or metadata of, or sends pieces of.
        gathered: arrays whose blocks are gathered to a writer, that it takes part in.
        assembling: the bytes it assembles by exchange so far (``FlatChunk.at``).
    """

    shards: list[ShardRecord] = field(default_factory=list)
    direct: list[DirectFlatWrite] = field(default_factory=list)
    straddling: list[tuple[int, FlatChunk]] = field(default_factory=list)
    metadata: list[str] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)
    gathered: set[str] = field(default_factory=set)
    assembling: int = 0

    def add_metadata(self, key: str) -> None:
        """``key``'s ``zarr.json``, which it writes."""
        self.metadata.append(key)

    def add_direct(self, write: DirectFlatWrite) -> None:
        """A chunk inside one of its flattened ranges."""
        self.direct.append(write)

    def add_gathered(self, key: str) -> None:
        """``key``, gathered to a writer, which it holds a block of or writes."""
        self.gathered.add(key)

    def add_assembled(self, key: str, tag: int, chunk: FlatChunk, nbytes: int) -> FlatChunk:
        """``chunk`` of ``nbytes``, which it assembles: placed after what it assembles
        so far; the chunk, so placed."""
        # FlatChunk's own constructor, not ``replace``: a 4,096-rank save makes a copy
        # per contributor, hundreds of thousands
        placed = FlatChunk(key, chunk.region, chunk.writer, chunk.pieces, self.assembling)
        self.assembling += nbytes
        self.straddling.append((tag, placed))
        self.touched.add(key)
        return placed

    def add_contribution(self, key: str, tag: int, chunk: FlatChunk) -> None:
        """``chunk`` as far as it sends pieces of it (``chunk.pieces``: its own)."""
        self.straddling.append((tag, chunk))
        self.touched.add(key)

    def plan(
        self, rank: int, records: dict[str, ArrayRecord], checkpoint_nbytes: int, commit: CommitRecord | None,
        assembled_bytes: int, largest_assembled: int,
    ) -> RankSavePlan:
        """Its frozen plan as rank ``rank``; the coordinator's (``commit``) writes the groups."""
        return RankSavePlan(
            rank=rank,
            records={k: records[k] for k in sorted(self.touched)},
            shards=tuple(self.shards),
            flat_direct=tuple(self.direct),
            straddling=tuple(self.straddling),
            array_metadata=tuple(self.metadata),
            group_metadata=tuple(parent_groups(list(records))) if commit is not None else (),
            checkpoint_nbytes=checkpoint_nbytes,
            commit=commit,
            gathered=frozenset(self.gathered),
            assembled_bytes=assembled_bytes,
            largest_assembled=largest_assembled,
        )


class _Exchanges:
    """The chunks a save assembles by exchange, handed to the ranks' parts (``parts``),
    each with its tag (``tag``: the next); and the bytes of the largest (``largest``)."""

    def __init__(self, parts: list[RankPart]) -> None:
        self.parts = parts
        self.tag = 0
        self.largest = 0

    def add(self, key: str, chunks: Iterable[FlatChunk], itemsize: int) -> None:
        """``chunks`` of ``key``: each to its writer, and to each contributor its own
        pieces (grouped once, not per rank: a small tensor's one chunk, or a shard, may
        gather pieces from every rank)."""
        for chunk in chunks:
            writer, nbytes = chunk.writer, chunk.volume * itemsize
            chunk = self.parts[writer].add_assembled(key, self.tag, chunk, nbytes)
            self.largest = max(self.largest, nbytes)
            by_rank: dict[int, list] = defaultdict(list)
            for piece in chunk.pieces:
                if piece[0] != writer:
                    by_rank[piece[0]].append(piece)
            for rank in sorted(by_rank):
                self.parts[rank].add_contribution(
                    key, self.tag, FlatChunk(key, chunk.region, writer, tuple(by_rank[rank]), chunk.at))
            self.tag += 1

    def gather(self, key: str, main: list[ShardRecord], chunks: list[FlatChunk], itemsize: int) -> None:
        """``key``'s ``chunks``, gathered from its ``main`` blocks to their writers: every
        holder and writer takes part (``RankSavePlan.gathered``)."""
        for rank in {s.rank for s in main} | {c.writer for c in chunks}:
            self.parts[rank].add_gathered(key)
        self.add(key, chunks, itemsize)


def plan_save(
    layout: GatheredShards, max_chunk_bytes: int, fully_parallel: bool, shard_bytes: int | None = None,
    pack_arrays_up_to: int = 0, read_grain: int | None = None,
) -> list[RankSavePlan]:
    """Every rank's part of the save of a validated layout (index = group rank);
    ``shard_bytes``: store arrays of small blocks in shards of about that size
    (``sharded_record``), each gathered to one writer, or, for large blocks split
    along a later axis, one per chunk inside its block, written by its holder
    (``in_block_sharded_record``). ``pack_arrays_up_to`` (the save's
    ``SaveOptions.pack_arrays_up_to``): arrays of at most that many bytes split over
    ranks are gathered whole to one writer, who packs them (``plan_packed_whole``);
    ``read_grain``: ``array_records``."""
    if fully_parallel:
        layout = balance_writers(layout)
    records, grids = array_records(layout, max_chunk_bytes, shard_bytes, read_grain)
    world = layout.world_size
    load = [0] * world  # bytes each rank writes of gathered shards and packed arrays
    parts = [RankPart() for _ in range(world)]
    exchanges = _Exchanges(parts)
    for ordinal, (key, key_shards) in enumerate(sorted(layout.tensors.items())):
        main = [s for s in key_shards if s.main]
        if not main:
            continue
        for s in main:  # its blocks: inline, not a call each (a million at 512 FSDP2 ranks)
            part = parts[s.rank]
            part.shards.append(s)
            part.touched.add(key)
        whole = plan_packed_whole(records[key], main, pack_arrays_up_to, load)
        if whole is not None:  # packed: its writer packs it, document included
            records[key], chunks = whole
            parts[chunks[0].writer].add_metadata(key)
            exchanges.gather(key, main, chunks, records[key].itemsize)
            continue
        parts[main[ordinal % len(main)].rank].add_metadata(key)
        if key in grids:  # gathered into shards (shards inside blocks are not in ``grids``)
            chunks = plan_gathered_writes(key, records[key], grids[key], load)
            exchanges.gather(key, main, chunks, records[key].itemsize)
        elif main[0].flat_range is not None:  # flattened ranges
            direct, straddling = plan_flat_writes(key, main, records[key].chunk_shape)
            for write in direct:
                parts[write.rank].add_direct(write)
            exchanges.add(key, straddling, records[key].itemsize)
        # else blocks: written by their holders, as their main shards say
    commit = CommitRecord(
        arrays=records,
        objects={
            key: ObjectRecord(key, tuple(sorted({o.unique_key for o in shards_ if o.main})))
            for key, shards_ in layout.objects.items()
        },
        world_size=world,
    )
    # the arrays' bytes: what the main shards of a valid layout cover, each element once
    nbytes, assembled_bytes = sum(r.nbytes for r in records.values()), max(p.assembling for p in parts)
    return [part.plan(rank, records, nbytes, commit if rank == 0 else None, assembled_bytes, exchanges.largest)
            for rank, part in enumerate(parts)]

