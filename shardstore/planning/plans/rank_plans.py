"""The frozen per-rank plans: what one rank does in a save (``RankSavePlan``), what
it reads and exchanges in a load (``RankReadPlan``), and its part of a load with its key
mismatches (``RankLoadPlan``). Made by ``plan_save`` and ``plan_reads``; each rank receives
only its own. A save plan's assembled chunks are cut into exchange waves of a bounded
size (``exchange_waves``), the same on every rank.
"""

from __future__ import annotations

__all__ = [
    "RankLoadPlan",
    "RankReadPlan",
    "RankSavePlan",
    "exchange_waves",
]

from collections.abc import Sequence
from dataclasses import dataclass

from shardstore.format.records import ArrayRecord, CommitRecord
from shardstore.planning.layout import (
    DirectFlatWrite,
    FlatChunk,
    ShardRecord,
)


@dataclass(frozen=True)
class RankSavePlan:
    """What one rank does in a save.

    Attributes:
        rank: the group rank it is for.
        records: the arrays it writes chunks or metadata of, or sends pieces of.
        shards: its main shards (after writer balancing): the blocks it writes, and its
            flattened ranges.
        flat_direct: chunks inside one of its flattened ranges, written directly.
        straddling: ``(tag, chunk)`` of the chunks that straddle flattened ranges and
            that it assembles (``chunk.writer``) or sends a piece of; the tag pairs the
            sends and receives, and is unique within the save.
        array_metadata: arrays whose ``zarr.json`` it writes: it holds a block of each,
            and the arrays whose blocks several ranks hold take their writers in turn
            (FSDP2's arrays, held by every rank, spread their files over all ranks).
        gathered: arrays whose blocks are gathered to a writer (``straddling``), not
            written block by block: into shards (``plan_gathered_writes``), or, for a
            packing save, whole into one chunk that writer packs (``plan_packed_whole``).
        assembled_bytes: the most bytes any rank assembles by exchange (the sum of
            its ``straddling`` chunks' sizes), and
        largest_assembled: the largest chunk any rank assembles, both the same in
            every rank's part: with ``FlatChunk.at``, what ``exchange_waves`` cuts into
            waves.
        group_metadata: groups whose ``zarr.json`` it writes (the coordinator).
        checkpoint_nbytes: tensor bytes of the whole checkpoint (for logging).
        commit: the coordinator's: the commit record to bind chunk checksums into.
    """

    rank: int
    records: dict[str, ArrayRecord]
    shards: tuple[ShardRecord, ...]
    flat_direct: tuple[DirectFlatWrite, ...]
    straddling: tuple[tuple[int, FlatChunk], ...]
    array_metadata: tuple[str, ...]
    group_metadata: tuple[str, ...]
    checkpoint_nbytes: int
    commit: CommitRecord | None = None
    gathered: frozenset[str] = frozenset()
    assembled_bytes: int = 0
    largest_assembled: int = 0


@dataclass(frozen=True)
class RankReadPlan:
    """What one rank reads in a load, and what it exchanges (indices are into its own
    list of requested ShardedTensors, then into ``forwards``).

    Attributes:
        rank: the group rank it is for.
        reads: the tensors it reads from storage.
        copies: ``(index, source)``: a block it asked for twice, filled from the copy it read.
        sends: ``(peer, indices)``: tensors it read that ``peer`` asked for too, in order.
        receives: ``(peer, indices)``: its tensors that ``peer`` reads and sends, in order.
        forwards: blocks it reads only for other ranks (a shard read once for all that
            ask for it: ``plan_reads``' ``shards``), as their requests' records; number
            ``k`` has index ``requested + k``.
        requested: the length of its own list with its pieces, as planned (set where it
            has forwards or pieces).
        pieces: ``(index, box)``: its requests split at the edges of the chunks they
            touch along their leading axis, where each chunk is read once
            (``plan_reads``' ``shards``): piece
            ``k`` of the rank's ``n`` requests is request ``n + k``, the part ``box``
            (``(start, stop)`` per axis of the block, prepended axes included; of a
            flattened range, one ``(start, stop)`` within the range) of request
            ``index``, which is then read only through its pieces.

    ``sends``, ``receives`` and ``forwards`` are tuples, or where planned in bulk
    sequences of the same entries held as numpy columns (``planning.columns``), equal
    to those tuples but no tuples themselves (``tuple(plan.sends)`` makes one); such a
    plan is not hashable.
    """

    rank: int
    reads: tuple[int, ...]
    copies: tuple[tuple[int, int], ...] = ()
    sends: Sequence[tuple[int, tuple[int, ...]]] = ()
    receives: Sequence[tuple[int, tuple[int, ...]]] = ()
    forwards: Sequence[ShardRecord] = ()
    requested: int = 0
    pieces: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()


@dataclass(frozen=True)
class RankLoadPlan:
    """One rank's part of a load: its key mismatches and its read plan.

    Attributes:
        missing: checkpoint keys that no rank requested (StrictHandling ``*_ALL`` only).
        unexpected: keys this rank requested that the checkpoint lacks; dropped from its
            request before reading when the strict mode says to skip them.
        reads: the sharded strategy's plan for this rank (``RankReadPlan`` for ours).
    """

    rank: int
    missing: frozenset[str]
    unexpected: frozenset[str]
    reads: object


def exchange_waves(plan: RankSavePlan, wave_bytes: int | None) -> list[tuple[tuple[int, FlatChunk], ...]]:
    """``plan.straddling`` cut into the exchange waves of a save that assembles at most
    about ``wave_bytes`` per rank at once (None: one wave): chunk ``c`` is in wave
    ``c.at // window``, so a rank's wave holds the chunks that start in its window (at
    most ``window`` plus the last one's size). The window is ``wave_bytes``, or the
    largest chunk where that is larger, so that the waves are never more than a
    rank's chunks. A pure function of the plan's global part and ``wave_bytes``: every
    rank gets as many waves, and each chunk's writer and contributors put it in the
    same one, as long as they pass the same ``wave_bytes`` (``execution.save.stage_save``
    has the ranks agree on it)."""
    if not wave_bytes or plan.assembled_bytes <= wave_bytes:
        return [plan.straddling]
    window = max(wave_bytes, plan.largest_assembled)
    waves: list[list[tuple[int, FlatChunk]]] = [[] for _ in range(-(-plan.assembled_bytes // window))]
    for tagged in plan.straddling:
        waves[tagged[1].at // window].append(tagged)
    return [tuple(w) for w in waves]
