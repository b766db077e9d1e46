"""Parts of a read plan held as numpy columns, not as a Python object per entry.

A load that reads each shard once (``planning.plans.plan_reads``' ``shards``) moves
nearly every block of an FSDP2 checkpoint between ranks: at 4,096 ranks millions of
blocks, each an entry of its reader's ``sends``, of its asker's ``receives`` and, on
its reader, a record of a block the reader did not ask for (``forwards``). Made and
pickled as Python objects on the coordinator, these were most of that load's plan
(``docs/measurements/scale.md``). The sequences here hold one rank's entries as a few
arrays: the coordinator slices them out of the whole plan's columns, they pickle as
those arrays, and the Python objects are made only by the rank that iterates its own.

They compare equal to the tuples the other plans hold (``plan.sends == ((1, (2,)),)``)
and are not hashable.
"""

from __future__ import annotations

__all__ = ["ForwardedBlocks", "PeerIndices", "record_rows", "row_width", "split_by_peer", "widened"]

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from shardstore.planning.layout import ShardRecord

# ``ForwardedBlocks.rows``' flag bits
_MAIN, _ALLOW_SHAPE_MISMATCH, _IRREGULAR, _MESH_REPLICA = 1, 2, 4, 8
# A row's columns besides its offset and block shape: flat start and stop, rank, index, flags.
_FIXED_COLUMNS = 5


def row_width(axes: int) -> int:
    """The columns of a ``ForwardedBlocks.rows`` row of blocks of ``axes`` axes."""
    return 2 * axes + _FIXED_COLUMNS


def _axes_of(rows: np.ndarray) -> int:
    """The axes ``rows`` (``row_width`` columns each) are laid out for."""
    return (rows.shape[1] - _FIXED_COLUMNS) // 2


class _TupleLike(Sequence):
    """Equality by value with any sequence (a tuple of the same entries included)."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]  (numpy columns: compared by value, never hashed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({tuple(self)!r})"


@dataclass(frozen=True, eq=False, repr=False)
class PeerIndices(_TupleLike, Sequence[tuple[int, tuple[int, ...]]]):
    """``(peer, indices)`` entries (``RankReadPlan.sends`` or ``receives``): entry ``i``
    is ``peers[i]`` with ``indices[bounds[i]:bounds[i + 1]]``.

    Attributes:
        peers: the peers, ascending.
        bounds: where each peer's indices start in ``indices``, and their end (one more
            than ``peers``).
        indices: every peer's indices, one after the other, each peer's in order.
    """

    peers: np.ndarray
    bounds: np.ndarray
    indices: np.ndarray

    def __len__(self) -> int:
        return len(self.peers)

    @overload
    def __getitem__(self, i: int) -> tuple[int, tuple[int, ...]]: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[tuple[int, tuple[int, ...]], ...]: ...

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self)[i]
        i = range(len(self))[i]  # IndexError past either end
        return int(self.peers[i]), tuple(self.indices[self.bounds[i] : self.bounds[i + 1]].tolist())

    def __iter__(self) -> Iterator[tuple[int, tuple[int, ...]]]:
        indices, bounds = self.indices.tolist(), self.bounds.tolist()
        for k, peer in enumerate(self.peers.tolist()):
            yield peer, tuple(indices[bounds[k] : bounds[k + 1]])


def split_by_peer(
    owner: np.ndarray, peer: np.ndarray, values: np.ndarray, world: int,
) -> list[PeerIndices | tuple[()]]:
    """Each rank's ``(peer, indices)`` entries: value ``i`` goes to ``owner[i]``'s entry
    for ``peer[i]``; a rank's peers ascending, each pair's values in their order here;
    ``()`` for a rank with none. In numpy, with a Python step per rank."""
    pair = owner.astype(np.int64) * world + peer
    order = np.argsort(pair, kind="stable")
    pair, values = pair[order], values[order]
    starts = np.flatnonzero(np.concatenate(([True], pair[1:] != pair[:-1]))) if len(pair) else np.zeros(0, np.int64)
    ends = np.append(starts[1:], len(pair))
    pair_owner, pair_peer = np.divmod(pair[starts], world)
    by_rank = np.searchsorted(pair_owner, np.arange(world + 1))
    out: list[PeerIndices | tuple[()]] = []
    for lo, hi in zip(by_rank[:-1].tolist(), by_rank[1:].tolist()):
        if lo == hi:
            out.append(())
            continue
        first, last = starts[lo], ends[hi - 1]
        out.append(PeerIndices(pair_peer[lo:hi].copy(), np.append(starts[lo:hi], last) - first,
                               values[first:last].copy()))
    return out


@dataclass(frozen=True, eq=False, repr=False)
class ForwardedBlocks(_TupleLike, Sequence[ShardRecord]):
    """Records of blocks (``RankReadPlan.forwards``) as rows of integers, the strings and
    shapes once per array; iterating makes the ``ShardRecord``s.

    Attributes:
        arrays: ``(key, dtype, global_shape)`` of each array the blocks belong to.
        array_of: per block, its array's position in ``arrays``.
        rows: per block: its offset and then its block shape, each padded to ``axes``
            entries, its flattened range's start and stop (-1 and -1: none), its rank,
            its index and its flags (``record_rows``).
    """

    arrays: tuple[tuple[str, str, tuple[int, ...]], ...]
    array_of: np.ndarray
    rows: np.ndarray

    @property
    def axes(self) -> int:
        return _axes_of(self.rows)

    def __len__(self) -> int:
        return len(self.array_of)

    @overload
    def __getitem__(self, i: int) -> ShardRecord: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[ShardRecord, ...]: ...

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self)[i]
        i = range(len(self))[i]  # IndexError past either end
        return self._record(int(self.array_of[i]), self.rows[i].tolist())

    def __iter__(self) -> Iterator[ShardRecord]:
        for a, row in zip(self.array_of.tolist(), self.rows.tolist()):
            yield self._record(a, row)

    def _record(self, array: int, row: list[int]) -> ShardRecord:
        key, dtype, shape = self.arrays[array]
        axes, ndim = self.axes, len(shape)
        start, stop, rank, index, flags = row[2 * axes :]
        return ShardRecord(
            key, rank, index, dtype, shape, tuple(row[:ndim]), tuple(row[axes : axes + ndim]),
            None if start < 0 else (start, stop), bool(flags & _MAIN), bool(flags & _ALLOW_SHAPE_MISMATCH),
            bool(flags & _IRREGULAR), bool(flags & _MESH_REPLICA),
        )


def record_rows(records: Sequence[ShardRecord], axes: int) -> np.ndarray:
    """The rows of ``records``, every one of ``axes`` axes, as ``ForwardedBlocks.rows``
    lays them out (one pass, no Python object per value)."""
    width = row_width(axes)
    flat = np.fromiter(itertools.chain.from_iterable([
        (*s.offset, *s.block_shape, *(s.flat_range or (-1, -1)), s.rank, s.index,
         (_MAIN if s.main else 0) | (_ALLOW_SHAPE_MISMATCH if s.allow_shape_mismatch else 0)
         | (_IRREGULAR if s.irregular else 0) | (_MESH_REPLICA if s.mesh_replica else 0))
        for s in records]), np.int64, len(records) * width)
    return flat.reshape(len(records), width)


def widened(rows: np.ndarray, axes: int) -> np.ndarray:
    """``record_rows`` of fewer axes laid out for ``axes`` (offsets and shapes padded with 0)."""
    have = _axes_of(rows)
    if have == axes:
        return rows
    out = np.zeros((len(rows), row_width(axes)), np.int64)
    out[:, :have], out[:, axes : axes + have], out[:, 2 * axes :] = rows[:, :have], rows[:, have : 2 * have], rows[:, 2 * have :]
    return out
