"""The coordinator's read plan of a load (``plan_reads``): which rank reads each
requested block and who sends it to whom; and the requests a rank's plan numbers
(``planned_requests``).
"""

from __future__ import annotations

__all__ = ["plan_reads", "planned_requests"]

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace

from shardstore.planning.layout import (
    GatheredShards,
    ShardRecord,
)
from shardstore.planning.plans.chunk_pieces import PiecesByRank, request_piece, split_at_chunk_edges
from shardstore.planning.plans.rank_plans import RankReadPlan
from shardstore.planning.plans.shared_reads import plan_shared_reads, single_asker_plans


def plan_reads(
    layout: GatheredShards, fully_parallel: bool, shards: Mapping[str, tuple[int, ...]] | None = None,
) -> list[RankReadPlan]:
    """Every rank's reads of a load (index = group rank).

    Without ``fully_parallel`` each rank reads everything it asked for. With it, a block
    that several ranks ask for (same region, flat range and dtype: replicas) is read
    from storage by one of them, chosen to balance the bytes each rank reads
    (``planning.layout.pick_balanced``), and sent to the others; a rank that asked twice for one
    block reads it once.

    ``shards`` (with ``fully_parallel``): the chunk shapes (a sharded array's shards) of
    arrays (key -> the record's ``chunk_shape``) whose chunks are each read by one rank:
    a block asked for whose leading axis runs over a chunk's edge is split there
    (``RankReadPlan.pieces``), and every block (or piece) asked for is read by one rank
    that asks for part of its chunk, balanced by bytes, and sent to the others, so a
    chunk is fetched once (one or two requests) instead of once per rank (at 4,096
    ranks, FSDP2's thousands of arrays each touch most ranks; a whole-tensor chunk
    loaded by FSDP2 or TP ranks, each asking for part of it). A reader holds at most
    ``MAX_FORWARDED_BYTES`` of blocks it did not ask for itself
    (``RankReadPlan.forwards``).
    """
    world = layout.world_size
    shards = shards or {}
    once = fully_parallel and layout.holds_each_block_once()  # no block asked for twice
    if not fully_parallel or (not shards and once):
        mine: list[list[int]] = [[] for _ in range(world)]  # each rank reads all it asked for
        for records in layout.tensors.values():
            for s in records:
                mine[s.rank].append(s.index)
        return [RankReadPlan(rank, tuple(sorted(mine[rank]))) for rank in range(world)]
    own = [0] * world
    for records in layout.tensors.values():
        for s in records:
            own[s.rank] += 1
    pieces: PiecesByRank = [[] for _ in range(world)]
    if once:  # each block asked for once (FSDP2: millions at 4,096 ranks)
        plans = single_asker_plans(layout, own, shards, pieces)
    else:
        layout = split_at_chunk_edges(layout, shards, own, pieces)
        requests: dict[tuple, list[ShardRecord]] = defaultdict(list)  # a block asked for twice (in one dtype or two)
        for records in layout.tensors.values():
            for s in records:  # ``ShardRecord.block_id`` and the dtype, as one tuple (millions at 4,096 ranks)
                requests[(s.key, s.offset, s.block_shape, s.flat_range, s.dtype)].append(s)
        plans = plan_shared_reads(list(requests.values()), own, shards)  # in the order of the gathered requests
    return [replace(plan, pieces=tuple(pieces[plan.rank]), requested=own[plan.rank]) if pieces[plan.rank] else plan
            for plan in plans]


def planned_requests(plan: RankReadPlan, own: Sequence[ShardRecord]) -> list[ShardRecord]:
    """Every request ``plan`` numbers, as records, by index: the rank's own (``own``, in
    the order of its list), its pieces, then its forwards."""
    pieces = [request_piece(own[i], box, len(own) + k) for k, (i, box) in enumerate(plan.pieces)]
    return [*own, *pieces, *plan.forwards]
