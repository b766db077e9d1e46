"""A fully parallel load around a strategy that is not shardstore's own returns exactly
the bytes each rank asked for when two ranks ask for different blocks at the same
offset of one tensor (issue 34.5).

The wrapper loads each shard on one rank and hands the loaded tensor to the other ranks
that hold "the same" shard. Megatron's shard id (key, global offset, flattened range)
makes two different requests one shard when they start at the same offset: the same
flattened range of blocks of different shapes (distributed-optimizer buffers), or
blocks of different sizes on an irregular grid. The receiver then got zeros, the next
tensor's bytes or garbage (a smaller block received into a larger tensor), or the
process aborted (a larger one into a smaller tensor). Each request is compared with
what shardstore's own strategy loads and with the stored tensor itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardstore import ShardedTensor, load, save
from shardstore.dict_utils import nested_values
from shardstore.protocol.collectives import Group
from shardstore.strategies.base import LoadShardedStrategy
from shardstore.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from shardstore.strategies.zarr import ZarrLoadShardedStrategy
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor

SHAPES = {"flat": (4, 4), "sizes": (8,), "sizes_reversed": (8,), "same": (6,)}


class ForeignReader(LoadShardedStrategy):
    """A load strategy that is not shardstore's own (the wrapper exchanges for it): it
    reads what this rank's part asks for from a shardstore checkpoint, on this rank
    alone, and records the keys it read."""

    def __init__(self) -> None:
        self.reader = ZarrLoadShardedStrategy(fully_parallel=False)
        self.read: list[str] = []

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        raise AssertionError("serialization.load gives the commit record: load_with_record is called")

    def load_with_record(self, sharded_state_dict: Any, location: Any, record: Any, process_group: Any = None) -> Any:
        self.read.extend(t.key for t in nested_values(sharded_state_dict))
        return self.reader.load_with_record(sharded_state_dict, location, record, Group.local())

    def load_tensors_metadata(self, checkpoint_dir: Any) -> Any:
        return self.reader.load_tensors_metadata(checkpoint_dir)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.reader.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.reader.check_version_compatibility(loaded_version)


def _request(key: str, local_shape: tuple[int, ...]) -> ShardedTensor:
    """An empty request for a block of ``key`` at offset 0 (an irregular grid: no axis
    fragmentations)."""
    shape = SHAPES[key]
    return ShardedTensor(key, torch.zeros(local_shape), torch.float32, local_shape, shape, (0,) * len(shape), None)


def _flat_request(local_shape: tuple[int, int]) -> ShardedTensor:
    """Megatron-style: the flattened range 0:4 of the first ``local_shape`` block of 'flat'."""
    fragments = [(axis, 0, SHAPES["flat"][axis] // n) for axis, n in enumerate(local_shape)]
    return ShardedTensor.from_rank_offsets_flat("flat", torch.zeros(4), local_shape, *fragments,
                                                flattened_range=slice(0, 4))


def requests(rank: int) -> dict[str, ShardedTensor]:
    """Rank 0 and rank 1 ask for different blocks at the same offset of each tensor but
    ``same``: the same flattened range (0:4) of a 2x4 and of a 2x2 block (``flat``: row 0
    vs a 2x2 corner), a block of 4 and of 8 elements (``sizes``), and the reverse
    (``sizes_reversed``)."""
    if rank == 0:
        return {"flat": _flat_request((2, 4)), "sizes": _request("sizes", (4,)),
                "sizes_reversed": _request("sizes_reversed", (8,)), "same": _request("same", (6,))}
    return {"flat": _flat_request((2, 2)), "sizes": _request("sizes", (8,)),
            "sizes_reversed": _request("sizes_reversed", (4,)), "same": _request("same", (6,))}


def expected_block(t: ShardedTensor) -> torch.Tensor:
    block = global_tensor(t.key, t.global_shape, t.dtype)[tuple(slice(0, n) for n in t.local_shape)]
    if t.flattened_range is not None:
        return block.flatten()[t.flattened_range].clone()
    return block.clone()


def load_both_ways(rank: int, world: int, ckpt: str) -> list[str]:
    whole = {key: ShardedTensor.from_rank_offsets(key, global_tensor(key, shape, torch.float32), replica_id=rank)
             for key, shape in SHAPES.items()}
    save(whole, ckpt)
    own = load(requests(rank), ckpt, validate_access_integrity=False)
    foreign = ForeignReader()
    wrapped = load(requests(rank), ckpt, FullyParallelLoadStrategyWrapper(foreign), validate_access_integrity=False)
    wrong = []
    for key, request in requests(rank).items():
        assert_bits_equal(own[key], expected_block(request), f"{key} (shardstore's own strategy)")
        try:
            assert_bits_equal(wrapped[key], expected_block(request), f"{key} on rank {rank}")
        except AssertionError as exc:
            wrong.append(str(exc))
    assert not wrong, f"the wrapped foreign strategy returned wrong bytes: {wrong}"
    return foreign.read


def test_different_blocks_at_one_offset_load_exactly_through_the_wrapper(tmp_path: Path) -> None:
    reads = run_distributed(load_both_ways, 2, str(tmp_path / "ckpt"), timeout=120)
    # each rank reads its own block of the three tensors it shares no block of;
    # the one shared block ('same') is read once and exchanged
    assert sorted(reads[0] + reads[1]) == ["flat", "flat", "same", "sizes", "sizes", "sizes_reversed",
                                           "sizes_reversed"], reads


class BlockReader(LoadShardedStrategy):
    """Megatron-Core's way in: a strategy of another library called by the wrapper's
    ``load`` directly; it returns exactly the block each request asks for."""

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        return {k: expected_block(t) for k, t in sharded_state_dict.items()}

    def load_tensors_metadata(self, checkpoint_dir: Any) -> Any:
        return {}

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        pass

    def check_version_compatibility(self, loaded_version: int) -> None:
        pass


def load_through_the_wrapper_alone(rank: int, world: int, algo: str) -> list[str]:
    loaded = FullyParallelLoadStrategyWrapper(BlockReader(), exchange_algo=algo).load(requests(rank), "unused")
    wrong = []
    for key, request in requests(rank).items():
        if not torch.equal(loaded[key], expected_block(request)):
            wrong.append(f"{key} on rank {rank}: {loaded[key].tolist()}, expected {expected_block(request).tolist()}")
    return wrong


@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds"])
def test_different_blocks_at_one_offset_load_exactly_through_the_wrappers_own_load(algo: str) -> None:
    """Megatron's way: ``wrapper.load(request, checkpoint_dir)``."""
    assert run_distributed(load_through_the_wrapper_alone, 2, algo, timeout=120) == [[], []]


def test_the_wrappers_load_distribution_tells_the_blocks_apart() -> None:
    """Pure: the load distribution the wrapper computes makes one shard of 'same' and
    two of each other tensor (one per rank), each loaded by its only holder."""
    from shardstore.compat.megatron.strategies.fully_parallel import _exchanged_shard_id
    from shardstore.exchange_utils import build_shard_distribution

    gathered = [[t.without_data() for t in requests(r).values()] for r in range(2)]
    distribution = build_shard_distribution(gathered, ignore_groups=True, shard_id_of=_exchanged_shard_id)
    holders = sorted((shard_id[0], tuple(ranks)) for shard_id, ranks in distribution.all_ranks_for_shard.items())
    assert holders == [("flat", (0,)), ("flat", (1,)), ("same", (0, 1)), ("sizes", (0,)), ("sizes", (1,)),
                       ("sizes_reversed", (0,)), ("sizes_reversed", (1,))]
