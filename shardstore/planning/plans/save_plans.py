"""The coordinator's save plan (``plan_save``): each array placed, by its kind, and its
writes handed to the ranks' parts.
"""

from __future__ import annotations

__all__ = ["plan_save"]

from collections import defaultdict

from shardstore.format.records import CommitRecord, ObjectRecord, parent_groups
from shardstore.planning.layout import (
    DirectFlatWrite,
    FlatChunk,
    GlobalLayout,
    ShardRecord,
    balance_writers,
)
from shardstore.planning.plans.array_storage import array_records
from shardstore.planning.plans.flat import plan_flat_writes
from shardstore.planning.plans.gathered import plan_gathered_writes
from shardstore.planning.plans.packed import plan_packed_whole
from shardstore.planning.plans.rank_plans import RankSavePlan


def plan_save(
    layout: GlobalLayout, max_chunk_bytes: int, fully_parallel: bool, shard_bytes: int | None = None,
    pack_arrays_up_to: int = 0,
) -> list[RankSavePlan]:
    """Every rank's part of the save of a validated layout (index = group rank);
    ``shard_bytes``: store arrays of small blocks in shards of about that size
    (``sharded_record``), each gathered to one writer, or, for large blocks split
    along a later axis, one per chunk inside its block, written by its holder
    (``in_block_sharded_record``). ``pack_arrays_up_to`` (the save's
    ``SaveOptions.pack_arrays_up_to``): arrays of at most that many bytes split over
    ranks are gathered whole to one writer, who packs them (``plan_packed_whole``)."""
    if fully_parallel:
        layout = balance_writers(layout)
    records, grids = array_records(layout, max_chunk_bytes, shard_bytes)
    world = layout.world_size
    load = [0] * world  # bytes each rank writes of gathered shards
    gathered: list[set[str]] = [set() for _ in range(world)]
    shards: list[list[ShardRecord]] = [[] for _ in range(world)]
    direct: list[list[DirectFlatWrite]] = [[] for _ in range(world)]
    straddling: list[list[tuple[int, FlatChunk]]] = [[] for _ in range(world)]
    metadata: list[list[str]] = [[] for _ in range(world)]
    touched: list[set[str]] = [set() for _ in range(world)]
    assembling = [0] * world  # bytes each rank assembles by exchange so far: ``FlatChunk.at``
    largest_assembled = 0
    tag = 0
    for ordinal, (key, key_shards) in enumerate(sorted(layout.tensors.items())):
        main = [s for s in key_shards if s.main]
        for s in main:
            shards[s.rank].append(s)
            touched[s.rank].add(key)
        whole = plan_packed_whole(records[key], main, pack_arrays_up_to, load) if main else None
        if whole is not None:  # its writer packs it, document included
            records[key] = whole[0]
            metadata[whole[1].writer].append(key)
        elif main:
            metadata[main[ordinal % len(main)].rank].append(key)
        gathered_key = key in grids  # shards inside blocks (not in ``grids``) are written as blocks are
        if not main or (main[0].flat_range is None and not gathered_key and whole is None):
            continue
        if whole is not None or gathered_key:  # whole into one chunk, or into shards
            key_direct = []
            key_straddling = [whole[1]] if whole is not None else plan_gathered_writes(key, records[key], grids[key], load)
            for rank in {s.rank for s in main} | {c.writer for c in key_straddling}:
                gathered[rank].add(key)
        else:
            key_direct, key_straddling = plan_flat_writes(key, main, records[key].chunk_shape)
        for write in key_direct:
            direct[write.rank].append(write)
        itemsize = records[key].itemsize
        for chunk in key_straddling:
            # FlatChunk's own constructor, not ``replace``: a 4,096-rank save makes a copy
            # per contributor, hundreds of thousands
            writer, nbytes = chunk.writer, chunk.volume * itemsize
            chunk = FlatChunk(key, chunk.region, writer, chunk.pieces, assembling[writer])
            assembling[writer] += nbytes
            largest_assembled = max(largest_assembled, nbytes)
            straddling[writer].append((tag, chunk))
            touched[writer].add(key)
            # a contributor needs only its own pieces (a small tensor's one chunk, or a
            # shard, may gather pieces from every rank): grouped once, not per rank
            by_rank: dict[int, list] = defaultdict(list)
            for piece in chunk.pieces:
                if piece[0] != writer:
                    by_rank[piece[0]].append(piece)
            for rank in sorted(by_rank):
                straddling[rank].append((tag, FlatChunk(key, chunk.region, writer, tuple(by_rank[rank]), chunk.at)))
                touched[rank].add(key)
            tag += 1
    commit = CommitRecord(
        arrays=records,
        objects={
            key: ObjectRecord(key, tuple(sorted({o.unique_key for o in shards_ if o.main})))
            for key, shards_ in layout.objects.items()
        },
        world_size=world,
    )
    # the arrays' bytes: what the main shards of a valid layout cover, each element once
    nbytes, assembled_bytes = sum(r.nbytes for r in records.values()), max(assembling)
    return [
        RankSavePlan(
            rank=rank,
            records={k: records[k] for k in sorted(touched[rank])},
            shards=tuple(shards[rank]),
            flat_direct=tuple(direct[rank]),
            straddling=tuple(straddling[rank]),
            array_metadata=tuple(metadata[rank]),
            group_metadata=tuple(parent_groups(list(records))) if rank == 0 else (),
            checkpoint_nbytes=nbytes,
            commit=commit if rank == 0 else None,
            gathered=frozenset(gathered[rank]),
            assembled_bytes=assembled_bytes,
            largest_assembled=largest_assembled,
        )
        for rank in range(world)
    ]
