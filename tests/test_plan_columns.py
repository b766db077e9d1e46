"""Read-plan parts held as numpy columns (``shardstore.planning.columns``): they give back
exactly the entries and records they were made from, compare equal to the tuples other
plans hold, and pickle as arrays."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from shardstore.planning.columns import (
    ForwardedBlocks,
    PeerIndices,
    record_rows,
    split_by_peer,
    widened,
)
from shardstore.planning.layout import GatheredShards, ShardRecord
from shardstore.planning.plans import plan_reads


def test_entries_split_by_owner_and_peer_keep_their_order() -> None:
    owner = np.array([1, 0, 1, 1, 0, 1])
    peer = np.array([2, 2, 0, 2, 1, 0])
    values = np.array([10, 11, 12, 13, 14, 15])
    out = split_by_peer(owner, peer, values, world=3)
    assert out[0] == ((1, (14,)), (2, (11,)))
    assert out[1] == ((0, (12, 15)), (2, (10, 13)))
    assert out[2] == () and isinstance(out[0], PeerIndices)
    assert list(out[1]) == [(0, (12, 15)), (2, (10, 13))] and out[1][-1] == (2, (10, 13)) and len(out[1]) == 2
    assert ((0, (12, 15)), (2, (10, 13))) == out[1]  # from either side
    assert out[1] != ((0, (12, 15)),) and out[1][:1] == ((0, (12, 15)),)
    with pytest.raises(IndexError):
        out[1][2]
    again = pickle.loads(pickle.dumps(out[1]))
    assert again == out[1] and isinstance(again.indices, np.ndarray)
    with pytest.raises(TypeError):
        hash(out[1])


RECORDS = [
    ShardRecord("a", 3, 7, "bfloat16", (8, 6), (4, 2), (2, 3), None, True),
    ShardRecord("b", 0, 1, "float32", (40,), (8,), (8,), (2, 5), False, allow_shape_mismatch=True),
    ShardRecord("a", 1, 0, "bfloat16", (8, 6), (0, 0), (4, 6), (0, 24), False, irregular=True),
    ShardRecord("c", 2, 5, "int64", (2**40, 3), (2**39, 1), (2**38, 2), None, True, True, True),
]


def test_forwarded_blocks_give_back_their_records_exactly() -> None:
    rows = np.concatenate([widened(record_rows([s], len(s.offset)), 2) for s in RECORDS])
    arrays = (("a", "bfloat16", (8, 6)), ("b", "float32", (40,)), ("c", "int64", (2**40, 3)))
    blocks = ForwardedBlocks(arrays, np.array([0, 1, 0, 2]), rows)
    assert list(blocks) == RECORDS and blocks == tuple(RECORDS) and len(blocks) == 4
    assert blocks[1] == RECORDS[1] and blocks[-1] == RECORDS[-1] and blocks[1:3] == tuple(RECORDS[1:3])
    for one, expected in zip(blocks, RECORDS):  # the same types: tuples of ints, bools
        assert all(type(x) is int for x in (*one.offset, *one.block_shape, one.rank, one.index)), one
        assert type(one.main) is bool and one.flat_range == expected.flat_range
    assert pickle.loads(pickle.dumps(blocks)) == tuple(RECORDS)


def test_a_bulk_plan_equals_the_same_plan_as_tuples() -> None:
    """Four ranks each ask for a quarter of one array stored in one shard (FSDP2's case):
    one of them reads the shard and sends the others theirs."""
    world = 4
    records = [([ShardRecord("w", r, 0, "float32", (8, 4), (2 * r, 0), (2, 4), None, True)], [])
               for r in range(world)]
    plans = plan_reads(GatheredShards.from_gathered(records), True, {"w": (8, 4)})
    reader = next(p for p in plans if p.forwards)
    assert isinstance(reader.forwards, ForwardedBlocks) and isinstance(reader.sends, PeerIndices)
    assert sorted((f.rank, f.index) for f in reader.forwards) == [(r, 0) for r in range(world) if r != reader.rank]
    assert reader.sends == tuple((f.rank, (1 + k,)) for k, f in enumerate(reader.forwards))
    for p in plans:
        if p is not reader:
            assert p.reads == () and p.receives == ((reader.rank, (0,)),) and not p.forwards
