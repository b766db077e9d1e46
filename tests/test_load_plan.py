"""Issue 14: a load plans once. The coordinator alone receives the requests, applies
StrictHandling, checks access integrity and decides who reads what; each rank receives
its part and reads only that."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardstore import ShardedTensor, StorageLayout, load, save
from shardstore.core import CheckpointingException
from shardstore.planning.layout import GatheredShards, ShardRecord
from shardstore.planning.plans import plan_reads
from shardstore.protocol.collectives import Group
from shardstore.validation import StrictHandling, plan_load
from tests.dist import run_distributed


def _record(key: str, rank: int, index: int, rows: int = 4, offset: int = 0, dtype: str = "float32") -> ShardRecord:
    return ShardRecord(key, rank, index, dtype, (16, 8), (offset, 0), (rows, 8), None, True)


def test_each_replicated_block_is_read_once_and_the_reads_are_balanced() -> None:
    # 4 ranks all ask for the same 4 equal blocks (a data-parallel group loading the model)
    per_rank = [([_record(f"w{i}", rank, i) for i in range(4)], []) for rank in range(4)]
    plans = plan_reads(GatheredShards.from_gathered(per_rank), fully_parallel=True)
    assert sorted(len(p.reads) for p in plans) == [1, 1, 1, 1]
    readers = {}
    for p in plans:
        for _peer, indices in p.sends:
            for i in indices:
                readers.setdefault(i, set()).add(p.rank)
        assert sum(len(ix) for _, ix in p.receives) == 3
    assert all(len(ranks) == 1 for ranks in readers.values()) and len(readers) == 4
    # what one rank sends to a peer, that peer receives from it, in the same number
    for p in plans:
        for peer, indices in p.sends:
            theirs = dict(plans[peer].receives)[p.rank]
            assert len(theirs) == len(indices)


def test_without_fully_parallel_every_rank_reads_what_it_asked_for() -> None:
    per_rank = [([_record(f"w{i}", rank, i) for i in range(3)], []) for rank in range(2)]
    plans = plan_reads(GatheredShards.from_gathered(per_rank), fully_parallel=False)
    assert [p.reads for p in plans] == [(0, 1, 2), (0, 1, 2)]
    assert all(not p.sends and not p.receives for p in plans)


def test_blocks_asked_for_once_are_read_by_their_askers_as_without_fully_parallel() -> None:
    """FSDP2's load: every block asked for by one rank. The fully parallel plan is the
    plain one (no choice to balance, nothing to send); one shared block among them
    still gets one reader and a send."""
    per_rank = [([_record(f"w{i}", rank, i, offset=4 * rank) for i in range(3)], []) for rank in range(4)]
    layout = GatheredShards.from_gathered(per_rank)
    assert plan_reads(layout, fully_parallel=True) == plan_reads(layout, fully_parallel=False)
    per_rank[1][0].append(_record("w0", 1, 3, offset=0))  # rank 1 asks for rank 0's block of w0 too
    plans = plan_reads(GatheredShards.from_gathered(per_rank), fully_parallel=True)
    assert sum(len(p.reads) for p in plans) == 12 and sum(len(ix) for p in plans for _, ix in p.sends) == 1


def test_replicas_asking_for_different_dtypes_each_get_a_reader() -> None:
    per_rank = [([_record("w", 0, 0, dtype="float32")], []), ([_record("w", 1, 0, dtype="bfloat16")], [])]
    plans = plan_reads(GatheredShards.from_gathered(per_rank), fully_parallel=True)
    assert [p.reads for p in plans] == [(0,), (0,)]


def test_a_block_asked_for_twice_by_one_rank_is_read_once() -> None:
    per_rank = [([_record("w", 0, 0), _record("w", 0, 1)], [])]
    (plan,) = plan_reads(GatheredShards.from_gathered(per_rank), fully_parallel=True)
    assert len(plan.reads) == 1 and len(plan.copies) == 1


def test_unexpected_keys_are_dropped_and_the_rest_renumbered() -> None:
    # rank 1 asks for "gone" (not in the checkpoint) between two keys it holds
    per_rank = [
        ([_record("a", 0, 0), _record("b", 0, 1)], []),
        ([_record("a", 1, 0), _record("gone", 1, 1), _record("b", 1, 2)], []),
    ]
    layout = GatheredShards.from_gathered(per_rank)
    plans = plan_load(layout, {"a", "b", "extra"}, StrictHandling.RETURN_ALL, False,
                      lambda lay: plan_reads(lay, fully_parallel=False))
    assert plans[1].unexpected == {"gone"} and plans[0].unexpected == set()
    assert plans[0].missing == plans[1].missing == {"extra"}
    assert plans[1].reads.reads == (0, 1)  # "b" is index 1 once "gone" is dropped
    with pytest.raises(CheckpointingException, match=r"Unexpected keys.*'gone'"):
        plan_load(layout, {"a", "b"}, StrictHandling.RAISE_UNEXPECTED, False, lambda lay: plan_reads(lay, False))


# ------------------------------------------------------------------ at 4 real ranks


def _save_replicated(rank: int, world: int, ckpt: str) -> None:
    torch.manual_seed(0)
    state = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.randn(64, 8), replica_id=rank) for i in range(8)}
    save(state, ckpt)


def _load_counting_collectives(rank: int, world: int, ckpt: str) -> dict:
    """Loads the 8 replicated tensors on every rank; counts the collectives and the
    tensors this rank read from storage."""
    import shardstore.execution.load as load_execution

    names = ("all_gather_object", "gather_object", "scatter_object", "gather_to_answer", "reduce_over_ranks")
    calls: dict[str, int] = dict.fromkeys(names, 0) | {"read": 0}
    originals = {name: getattr(Group, name) for name in names}

    def counting(name):
        def wrapper(self, *args, **kwargs):
            calls[name] += 1
            return originals[name](self, *args, **kwargs)
        return wrapper

    original_read = load_execution.load_tensors

    def counting_read(tensors, *args, **kwargs):
        calls["read"] += len(tensors)
        return original_read(tensors, *args, **kwargs)

    for name in originals:
        setattr(Group, name, counting(name))
    load_execution.load_tensors = counting_read
    try:
        request = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.empty(64, 8), replica_id=rank)
                   for i in range(8)}
        loaded = load(request, ckpt)
    finally:
        for name, fn in originals.items():
            setattr(Group, name, fn)
        load_execution.load_tensors = original_read
    torch.manual_seed(0)
    for i in range(8):
        assert torch.equal(loaded[f"w{i}"], torch.randn(64, 8)), f"rank {rank} w{i}"
        # read here or received from the rank that read it: either way in the request's memory
        assert loaded[f"w{i}"] is request[f"w{i}"].data, f"rank {rank} w{i}: not filled in place"
    return calls


def test_a_load_gathers_twice_and_each_replica_reads_its_share(ckpt_dir: Path) -> None:
    run_distributed(_save_replicated, 2, str(ckpt_dir))
    calls = run_distributed(_load_counting_collectives, 4, str(ckpt_dir))
    for rank, c in enumerate(calls):
        # two gathers answered by the coordinator (the opening's record and common files,
        # broadcast; the plan, scattered), one all-reduce (the read's agreement)
        assert (c["gather_to_answer"], c["reduce_over_ranks"]) == (2, 1), (rank, c)
        assert c["gather_object"] == c["scatter_object"] == c["all_gather_object"] == 0, (rank, c)
        assert c["read"] == 2, (rank, c)  # 8 replicated tensors over 4 ranks


def _load_with_one_rank_asking_for_a_missing_key(rank: int, world: int, ckpt: str) -> str:
    request = {"w0": ShardedTensor.from_rank_offsets("w0", torch.empty(64, 8), replica_id=rank)}
    if rank == 1:
        request["nope"] = ShardedTensor.from_rank_offsets("nope", torch.empty(2), replica_id=0)
    with pytest.raises(CheckpointingException) as info:
        load(request, ckpt, strict=StrictHandling.RAISE_UNEXPECTED)
    return str(info.value)


def test_a_strict_mismatch_on_one_rank_fails_every_rank(ckpt_dir: Path) -> None:
    run_distributed(_save_replicated, 2, str(ckpt_dir))
    messages = run_distributed(_load_with_one_rank_asking_for_a_missing_key, 3, str(ckpt_dir), timeout=60)
    assert all("Unexpected keys" in m and "'nope'" in m for m in messages), messages


def _load_tied_replicas(rank: int, world: int, ckpt: str) -> None:
    tied = torch.zeros(64, 8)
    request = {key: ShardedTensor.from_rank_offsets(key, tied, replica_id=rank) for key in ("w0", "w1")}
    loaded = load(request, ckpt)
    torch.manual_seed(0)
    w0, w1 = torch.randn(64, 8), torch.randn(64, 8)
    assert torch.equal(loaded["w0"], w0) and torch.equal(loaded["w1"], w1), f"rank {rank}"
    assert sum(loaded[k] is tied for k in ("w0", "w1")) == 1, "one of the two keys gets the tied memory"


def test_tied_request_tensors_keep_their_own_values_when_blocks_are_exchanged(ckpt_dir: Path) -> None:
    """One tensor requested under two keys on 2 ranks: each rank reads one key and
    receives the other from its peer; the received block must not land in memory a read
    already filled."""
    run_distributed(_save_replicated, 2, str(ckpt_dir))
    run_distributed(_load_tied_replicas, 2, str(ckpt_dir))


def test_shard_records_travel_without_their_field_names_and_come_back_equal() -> None:
    """Every rank's records are pickled to the coordinator (millions at 4,096 ranks):
    as a tuple of field values, not a dict naming every field, and back equal, frozen
    and hashable as before."""
    import dataclasses
    import pickle

    records = [_record("w", 0, 0), ShardRecord("v", 3, 1, "bfloat16", (6,), (2,), (4,), (1, 3), False, True, True)]
    data = pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"global_shape" not in data and b"allow_shape_mismatch" not in data
    back = pickle.loads(data)
    assert back == records and [hash(r) for r in back] == [hash(r) for r in records]
    with pytest.raises(dataclasses.FrozenInstanceError):
        back[0].rank = 1


def test_a_shard_read_once_is_read_by_one_asker_who_sends_the_others_their_blocks() -> None:
    """FSDP2's load of a sharded array: 4 ranks each ask for their 4 rows of ``w0``,
    stored in shards of 8 rows. Each shard is read by one of its two askers, which reads
    the other's block too (a forward, index 2: past its own two requests) and sends it;
    the other array, not sharded, is read as before."""
    per_rank = [([_record("w0", rank, 0, offset=4 * rank), _record("w1", rank, 1, offset=4 * rank)], [])
                for rank in range(4)]
    layout = GatheredShards.from_gathered(per_rank)
    plans = plan_reads(layout, fully_parallel=True, shards={"w0": (8, 8)})
    assert [p.reads for p in plans] == [(0, 1, 2), (1,), (0, 1, 2), (1,)]  # ranks 0 and 2 read w0's shards
    assert [[(f.rank, f.index, f.offset) for f in p.forwards] for p in plans] == [[(1, 0, (4, 0))], [],
                                                                                  [(3, 0, (12, 0))], []]
    assert [p.sends for p in plans] == [((1, (2,)),), (), ((3, (2,)),), ()]
    assert [p.receives for p in plans] == [(), ((0, (0,)),), (), ((2, (0,)),)]
    assert plan_reads(layout, fully_parallel=False, shards={"w0": (8, 8)}) == plan_reads(layout, False)


def test_a_block_over_a_shard_edge_is_split_into_pieces_numbered_after_the_requests() -> None:
    """Rank 0 asks for rows 0-5 of ``w`` (shards of 4 rows), rank 1 for rows 6-11 and
    for a block of ``v`` (not read once). Each block over a shard's edge is split there:
    the pieces are requests of their rank numbered after its own (rank 0: 1, 2; rank 1:
    2, 3), the split requests are never read whole, and the shard of rows 4-7, which
    both ask for, is read by one of them (rank 0: rank 1's piece is its forward 3, after
    its pieces), who sends the other its piece."""
    per_rank = [([_record("w", 0, 0, rows=6, offset=0)], []),
                ([_record("w", 1, 0, rows=6, offset=6), _record("v", 1, 1)], [])]
    plans = plan_reads(GatheredShards.from_gathered(per_rank), fully_parallel=True, shards={"w": (4, 8)})
    assert [p.pieces for p in plans] == [((0, ((0, 4), (0, 8))), (0, ((4, 6), (0, 8)))),
                                         ((0, ((0, 2), (0, 8))), (0, ((2, 6), (0, 8))))]
    assert [p.requested for p in plans] == [3, 4]  # requests and pieces
    assert [p.reads for p in plans] == [(1, 2, 3), (1, 3)]  # never 0, the split requests
    assert [(f.rank, f.index, f.offset, f.block_shape) for f in plans[0].forwards] == [(1, 2, (6, 0), (2, 8))]
    assert tuple(plans[0].sends) == ((1, (3,)),) and tuple(plans[1].receives) == ((0, (2,)),)
    unsplit = plan_reads(GatheredShards.from_gathered(per_rank), fully_parallel=True)
    assert not any(p.pieces for p in unsplit)  # nothing read once: nothing split


def test_a_block_is_split_along_its_leading_axis_only() -> None:
    """A part of a block's leading axis (its first of more than one element) is a
    contiguous run of its tensor; a part along a later axis is strided, and would land in
    a buffer of its own first. So a block of columns over shards of columns is read
    whole, as before, and a layer-stacked block (a prepended axis of 1) is split along
    its rows."""
    columns = [([ShardRecord("w", r, 0, "float32", (8, 16), (0, 6 * r), (8, 6), None, True)], []) for r in range(2)]
    plans = plan_reads(GatheredShards.from_gathered(columns), fully_parallel=True, shards={"w": (8, 4)})
    assert not any(p.pieces for p in plans)
    stacked = [([ShardRecord("l", r, 0, "float32", (2, 12, 8), (1, 6 * r, 0), (1, 6, 8), None, True)], [])
               for r in range(2)]
    plans = plan_reads(GatheredShards.from_gathered(stacked), fully_parallel=True, shards={"l": (1, 4, 8)})
    assert plans[0].pieces == ((0, ((0, 1), (0, 4), (0, 8))), (0, ((0, 1), (4, 6), (0, 8))))


def test_a_shard_reader_reads_blocks_it_did_not_ask_for_as_forwards() -> None:
    """Rank 0 asks for rows 0-3 of a shard of 12 rows; rank 1 for rows 4-7 and 8-11
    (larger): rank 0 reads the shard (fewest bytes so far), the two blocks of rank 1
    as forwards, indices past its own request (1 and 2), and sends them."""
    per_rank = [([_record("w", 0, 0, offset=0)], []),
                ([_record("w", 1, 0, offset=4), _record("w", 1, 1, offset=8)], [])]
    plans = plan_reads(GatheredShards.from_gathered(per_rank), fully_parallel=True, shards={"w": (12, 8)})
    assert plans[0].reads == (0, 1, 2) and plans[1].reads == ()
    assert [(f.rank, f.index) for f in plans[0].forwards] == [(1, 0), (1, 1)]
    assert plans[0].sends == ((1, (1, 2)),) and plans[1].receives == ((0, (0, 1)),)


def test_forwards_past_the_bound_are_read_by_each_asker(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardstore.planning.plans.read_plans as plans_module

    block = 4 * 8 * 4  # 4 rows of 8 float32
    per_rank = [([_record("w", 0, 0, offset=0)], []), ([_record("w", 1, 0, offset=4)], [])]
    monkeypatch.setattr(plans_module, "MAX_FORWARDED_BYTES", block)
    plans = plan_reads(GatheredShards.from_gathered(per_rank), fully_parallel=True, shards={"w": (8, 8)})
    assert [p.reads for p in plans] == [(0, 1), ()] and plans[0].sends == ((1, (1,)),)
    monkeypatch.setattr(plans_module, "MAX_FORWARDED_BYTES", block - 1)
    plans = plan_reads(GatheredShards.from_gathered(per_rank), fully_parallel=True, shards={"w": (8, 8)})
    assert [p.reads for p in plans] == [(0,), (0,)] and not plans[0].forwards and not plans[0].sends


def test_a_shard_goes_to_an_asker_it_keeps_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 asks for row 0 of an 8-row shard, rank 1 for rows 1-7, the bound 4 rows:
    rank 0 (fewest bytes so far, the lowest rank) would hold 7 rows for rank 1, so rank
    1 reads the shard and holds row 0 for rank 0. Before, only the first choice was
    tried, and each rank read the shard."""
    import shardstore.planning.plans.read_plans as plans_module

    per_rank = [([_record("w", 0, 0, rows=1, offset=0)], []), ([_record("w", 1, 0, rows=7, offset=1)], [])]
    monkeypatch.setattr(plans_module, "MAX_FORWARDED_BYTES", 4 * 8 * 4)
    plans = plan_reads(GatheredShards.from_gathered(per_rank), fully_parallel=True, shards={"w": (8, 8)})
    assert [p.reads for p in plans] == [(), (0, 1)] and [(f.rank, f.index) for f in plans[1].forwards] == [(0, 0)]
    assert plans[1].sends == ((0, (1,)),) and plans[0].receives == ((1, (0,)),)


def test_a_flattened_range_is_read_in_the_shards_its_rows_cross() -> None:
    """Distributed-optimizer fragments: ranks 0 and 1 split one block of 8 x 8 flat, in
    shards of 4 rows. A range starting at row 4 lies in the second shard; one from row 2
    is split at row 4: its first piece is read by the first shard's reader (rank 0) and
    sent, its second by rank 1 itself, so no shard is read twice."""
    def fragment(rank: int, start: int, stop: int) -> ShardRecord:
        return ShardRecord("f", rank, 0, "float32", (8, 8), (0, 0), (8, 8), (start, stop), True)

    layout = GatheredShards.from_gathered([([fragment(0, 0, 32)], []), ([fragment(1, 32, 64)], [])])
    assert plan_reads(layout, True, shards={"f": (4, 8)}) == plan_reads(layout, False)
    layout = GatheredShards.from_gathered([([fragment(0, 0, 16)], []), ([fragment(1, 16, 64)], [])])
    first, second = plan_reads(layout, True, shards={"f": (4, 8)})
    assert second.pieces == ((0, ((0, 16),)), (0, ((16, 48),)))  # rows 2-3, rows 4-7
    assert [f.flat_range for f in first.forwards] == [(16, 32)]
    assert (first.reads, tuple(first.sends), second.reads, tuple(second.receives)) == (
        (0, 1), ((1, (1,)),), (2,), ((0, (1,)),))


def test_a_strategy_planning_from_the_layout_alone_still_loads(tmp_path: Path) -> None:
    """A load strategy written before ``plan_load`` took the commit record (its override
    takes the layout alone) is called without it."""
    from shardstore.strategies.zarr import ZarrLoadShardedStrategy

    class LayoutOnly(ZarrLoadShardedStrategy):
        def plan_load(self, layout: GatheredShards) -> list:  # type: ignore[override]
            self.planned = True
            return super().plan_load(layout)

    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}, tmp_path / "ckpt")
    strategy = LayoutOnly()
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}, tmp_path / "ckpt",
                  sharded_strategy=strategy)
    assert strategy.planned and torch.equal(loaded["w"], torch.arange(8.0))


def test_a_plan_with_forwards_refuses_another_list_of_requests(tmp_path: Path) -> None:
    """Forwards are numbered after the rank's own requests as planned: a list of
    another length is refused, naming the checkpoint, not filled wrongly."""
    from shardstore.execution.load import run_read_plan
    from shardstore.format.records import read_commit_record
    from shardstore.planning.plans import RankReadPlan
    from shardstore.stores.locations import open_location

    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}, tmp_path / "ckpt")
    location = open_location(tmp_path / "ckpt")
    forward = ShardRecord("w", 1, 0, "float32", (8,), (0,), (8,), None, True)
    plan = RankReadPlan(0, (1,), forwards=(forward,), requested=2)
    request = [ShardedTensor.from_rank_offsets("w", torch.zeros(8))]
    with pytest.raises(CheckpointingException, match="made for 2 requested tensors on rank 0, which passes 1"):
        run_read_plan(request, location, read_commit_record(location), plan, Group(None))
    # a rank that already failed keeps its first failure and names the second
    earlier = CheckpointingException("the strict check failed first")
    with pytest.raises(CheckpointingException, match="the strict check failed first") as raised:
        run_read_plan(request, location, read_commit_record(location), plan, Group(None), local_error=earlier)
    assert any("made for 2 requested tensors" in note for note in raised.value.__notes__), raised.value


def test_a_request_on_the_meta_device_gets_its_values_on_the_cpu(tmp_path: Path) -> None:
    """A model built on the meta device describes its request with meta tensors, which
    hold no values: the load returns the committed values on the CPU (as Megatron-Core's
    zarr backend returns every tensor), bit-exact. Before, the read values were moved
    to the meta device and the load returned tensors with no data at all."""
    torch.manual_seed(0)
    saved = torch.randn(6, 8)
    save({"w": ShardedTensor.from_rank_offsets("w", saved)}, tmp_path / "ckpt")
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(6, 8, device="meta"))}
    loaded = load(request, tmp_path / "ckpt")["w"]
    assert loaded.device.type == "cpu" and torch.equal(loaded, saved)


def _load_replicas_into_meta(rank: int, world: int, ckpt: str) -> None:
    request = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.empty(64, 8, device="meta"), replica_id=rank)
               for i in range(2)}
    loaded = load(request, ckpt)
    torch.manual_seed(0)
    for i in range(2):
        expected = torch.randn(64, 8)
        assert loaded[f"w{i}"].device.type == "cpu" and torch.equal(loaded[f"w{i}"], expected), f"rank {rank} w{i}"


def test_replicas_on_the_meta_device_receive_their_blocks_on_the_cpu(ckpt_dir: Path) -> None:
    """Replicas requested as meta tensors: each block is read by one rank and sent to
    the other. Before, the reader's result was a meta tensor, and the exchange failed
    on every rank with ``NotImplementedError: Cannot copy out of meta tensor``."""
    run_distributed(_save_replicated, 2, str(ckpt_dir))
    run_distributed(_load_replicas_into_meta, 2, str(ckpt_dir), timeout=60)


def test_the_zarr_modules_single_tensor_read_of_a_committed_checkpoint_refuses_a_missing_chunk(
    tmp_path: Path,
) -> None:
    """Megatron's ``_load_from_array``, given a committed shardstore checkpoint, reads
    it as ``load`` does: every chunk bound by the commit record. Before, it read the
    array through TensorStore as a bare directory, and a chunk file gone from the
    checkpoint came back as rows of zeros, with no error."""
    from shardstore.strategies.zarr import ZarrSaveShardedStrategy, _load_from_array

    saved = torch.arange(64.0).reshape(8, 8) + 1
    per_array = StorageLayout(pack_arrays_up_to=0)  # a chunk file of its own, to delete
    save({"w": ShardedTensor.from_rank_offsets("w", saved)}, tmp_path / "ckpt",
         ZarrSaveShardedStrategy(max_chunk_bytes=64, layout=per_array))
    request = ShardedTensor.from_rank_offsets("w", torch.empty(8, 8))
    assert torch.equal(_load_from_array(request, tmp_path / "ckpt"), saved)
    (tmp_path / "ckpt" / "w" / "c.1.0").unlink()
    with pytest.raises(CheckpointingException, match=r"Missing chunk c\.1\.0 of array 'w'"):
        _load_from_array(request, tmp_path / "ckpt")
