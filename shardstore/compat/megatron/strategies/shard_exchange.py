"""Which rank of a parallelization group saves or loads each shard, and how the shards
one rank loaded reach the other ranks that hold them: the fully-parallel wrappers'
distribution (``strategies.fully_parallel``) around strategies that are not shardstore's
own; shardstore's own strategies balance and exchange inside their plans. The
distribution is Megatron's greedy balance, rank for rank, because Megatron's users and
tests rely on which rank saves which key. Every collective goes through
``protocol.collectives.Group``; ``parallelization_group=None`` is the world. Megatron-Core's
``dist_checkpointing.exchange_utils`` names are ``shardstore.compat.megatron.exchange_utils``.

Which functions are collective on the group: ``determine_main_replica_uniform_distribution``
(one all-gather of shard metadata, never data), calling what
``prepare_exchange_by_distribution`` returns, and ``exchange_loaded_objects_gather_object``.
``distribute_shards_to_ranks`` is pure; ``prepare_exchange_by_distribution`` makes the
exchange's allocations with no collective (before a stage's agreement), and calling its
result runs the exchange.
"""

from __future__ import annotations

__all__ = [
    "EXCHANGE_ALGOS", "PreparedShardExchange", "ShardDistribution", "build_shard_distribution",
    "determine_main_replica_uniform_distribution", "distribute_shards_to_ranks",
    "exchange_loaded_objects_gather_object", "prepare_exchange_by_distribution",
]

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from shardstore.dict_utils import nested_values
from shardstore.errors import CheckpointingException
from shardstore.execution.loaded import result_device
from shardstore.mapping import ShardedStateDict, ShardedTensor, is_main_replica
from shardstore.protocol.collectives import Group
from shardstore.utils import _sharded_tensor_shard_id, _ShardId

logger = logging.getLogger(__name__)

# 'broadcast': one broadcast per shard that more than one rank holds (Megatron's
# default). 'gather_rounds' and 'gather_object': one point-to-point exchange in which
# each loading rank sends a shard only to the ranks that hold it, packed one buffer per
# pair of ranks; both names give the same tensors as Megatron's algorithms of that name.
EXCHANGE_ALGOS = ("broadcast", "gather_rounds", "gather_object")

T = TypeVar("T")


class ShardDistribution(NamedTuple):
    """Who does the work for each shard, valid for one parallelization group (which it
    does not name). Identical on every rank of the group: every rank computes it from
    the same gathered metadata.

    Fields:
        main_rank_for_shard: group rank that saves (or loads) each shard.
        shards_in_this_group: shards this group is responsible for.
        shard_to_metadata: a data-less ShardedTensor for each shard (shape, dtype).
        all_ranks_for_shard: group ranks whose state dict holds each shard.
    """

    main_rank_for_shard: dict[_ShardId, int]
    shards_in_this_group: set[_ShardId]
    shard_to_metadata: dict[_ShardId, ShardedTensor]
    all_ranks_for_shard: dict[_ShardId, list[int]]


def _shard_size(sh_ten: ShardedTensor) -> int:
    """Bytes of the shard's local shape (the whole local shape even for a flattened
    range, as Megatron counts it, so both balance the same way)."""
    return math.prod(sh_ten.local_shape) * sh_ten.dtype.itemsize


def distribute_shards_to_ranks(
    shard_to_ranks: dict[T, list[int]],
    shard_to_size: dict[T, int],
    num_ranks: int,
    cross_parallelization_group_loads: set[T] | frozenset[T] = frozenset(),
) -> dict[T, int]:
    """Assigns each shard to one of the ranks that hold it, balancing bytes greedily.

    Shards are taken in this order: those with a main replica in the group before the
    cross-group loads (so a load reads where the save wrote), then fewest holders first
    (they have the least choice), then larger first, then by shard id (so every rank
    computes the same result; a whole block's id, whose flattened range is None, before
    the ids of its flattened ranges). Each goes to the holder with the fewest bytes
    assigned so far, the lowest rank on a tie. Pure: no collective.

    Args:
        shard_to_ranks: which ranks hold each shard.
        shard_to_size: bytes of each shard.
        num_ranks: ranks in the group.
        cross_parallelization_group_loads: shards whose main replica is in another
            group (load only).

    Returns:
        The rank assigned to each shard.
    """
    assigned_bytes = [0] * num_ranks
    assignment: dict[T, int] = {}

    def order(item: tuple[T, list[int]]) -> tuple:
        shard_id, ranks = item
        return (shard_id in cross_parallelization_group_loads, len(ranks), -shard_to_size[shard_id],
                _comparable(shard_id))

    for shard_id, ranks in sorted(shard_to_ranks.items(), key=order):
        rank = min(ranks, key=lambda r: (assigned_bytes[r], r))
        assignment[shard_id] = rank
        assigned_bytes[rank] += shard_to_size[shard_id]
    logger.debug("distribute_shards_to_ranks: bytes per rank %s", assigned_bytes)
    return assignment


def _comparable(shard_id: T) -> T | tuple:
    """``shard_id`` as a sort key: a part that is None (no flattened range) as ``()``,
    which sorts before any range, so that the ids of a whole block and of a flattened
    range of it (one rank loads the block, another a range: both the same size)
    compare; the order of any other ids is unchanged."""
    if not isinstance(shard_id, tuple):
        return shard_id
    return tuple(() if part is None else part for part in shard_id)


def build_shard_distribution(
    all_shards: list[list[ShardedTensor]], ignore_groups: bool,
    shard_id_of: Callable[[ShardedTensor], _ShardId] = _sharded_tensor_shard_id,
) -> ShardDistribution:
    """The distribution of already gathered shard metadata (``all_shards[r]``: group rank
    r's ShardedTensors). Pure, so it can be checked without processes.

    ``ignore_groups=False`` (save): only shards with a main replica in the group.
    ``True`` (load): every shard some rank of the group holds; those without a main
    replica here are assigned last. ``shard_id_of``: what makes two ranks' shards one
    (Megatron's key, offset and flattened range by default; the load wrapper adds the
    local shape and dtype, as it hands the loaded tensor itself to the other holders)."""
    shard_to_ranks: dict[_ShardId, list[int]] = defaultdict(list)
    shard_to_size: dict[_ShardId, int] = {}
    shard_to_metadata: dict[_ShardId, ShardedTensor] = {}
    with_main: set[_ShardId] = set()
    for rank, rank_shards in enumerate(all_shards):
        for sh_ten in rank_shards:
            shard_id = shard_id_of(sh_ten)
            shard_to_ranks[shard_id].append(rank)
            if shard_id not in shard_to_metadata:
                shard_to_metadata[shard_id] = sh_ten
                shard_to_size[shard_id] = _shard_size(sh_ten)
            if is_main_replica(sh_ten.replica_id):
                with_main.add(shard_id)
    in_group = set(shard_to_ranks) if ignore_groups else with_main
    holders = {k: v for k, v in shard_to_ranks.items() if k in in_group}
    main_rank = distribute_shards_to_ranks(holders, shard_to_size, len(all_shards), in_group - with_main)
    return ShardDistribution(main_rank, in_group, shard_to_metadata, holders)


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group: dist.ProcessGroup | None,
    ignore_groups: bool = False,
    shard_id_of: Callable[[ShardedTensor], _ShardId] = _sharded_tensor_shard_id,
) -> ShardDistribution | None:
    """Collective on ``parallelization_group``: gathers every rank's shard metadata (no
    data) and computes the balanced distribution (``build_shard_distribution``, shards
    identified by ``shard_id_of``), the same on every rank. None for a group of one rank
    (nothing to distribute).

    Megatron's ``pg_cache_path``/``pg_cache_create`` (a pickled distribution on disk) are
    not offered: loading a pickle from disk runs code, which shardstore never does."""
    group = Group(parallelization_group)
    if group.world_size <= 1:
        return None
    local = [t.without_data() for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
    return build_shard_distribution(group.all_gather_object(local), ignore_groups, shard_id_of)


def _get_empty_tensor_for_exchange(
    shard_id: _ShardId,
    needed_shards: dict[_ShardId, ShardedTensor],
    loaded_tensors: dict[_ShardId, torch.Tensor],
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.device]:
    """The tensor a rank that did not load ``shard_id``, which it holds (in
    ``needed_shards``), receives it into, on ``device`` (the group's: CUDA for NCCL),
    and where the request wanted it: the request's own tensor when that is contiguous
    and on ``device``, else a new one, wanted where a load puts the request's values
    (``execution.loaded.result_device``: the CPU for a request on the meta device). It
    is recorded in ``loaded_tensors``."""
    request = needed_shards[shard_id]
    request.init_data(device)
    data = request.data
    if data.device == torch.device(device) and data.is_contiguous():
        tensor = data
    else:
        tensor = torch.empty(data.shape, dtype=data.dtype, device=device)
    loaded_tensors[shard_id] = tensor
    return tensor, result_device(request)


def _scratch_numel(meta: ShardedTensor) -> int:
    """Elements of the shard ``meta`` describes, as it travels (its flattened range's)."""
    f_range = meta.flattened_range
    return math.prod(meta.local_shape) if f_range is None else f_range.stop - f_range.start


class _Scratch:
    """One buffer that every shard this rank does not hold is received into in turn
    (a broadcast reaches the whole group): allocated once, before the exchange, the
    size of the largest, so a load never holds more than one scratch shard."""

    def __init__(self, shards: list[ShardedTensor], device: torch.device) -> None:
        nbytes = max((_scratch_numel(m) * m.dtype.itemsize for m in shards), default=0)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def view(self, meta: ShardedTensor) -> torch.Tensor:
        """The buffer's first bytes as the shard ``meta`` describes (contiguous)."""
        numel = _scratch_numel(meta)
        return self.buffer[: numel * meta.dtype.itemsize].view(meta.dtype)


def _shared_shards(distribution: ShardDistribution) -> Iterator[tuple[_ShardId, int, list[int]]]:
    """(shard id, loading rank, holders) of each shard that another rank holds too, in
    the distribution's order (the same on every rank, so collectives pair up). A shard
    only its loader holds needs no exchange. Each holder is named once: a rank whose
    state dict asks for a shard twice (``all_ranks_for_shard`` lists it twice, as
    Megatron's does) receives it once, as it posts one receive for it."""
    for shard_id, src in distribution.main_rank_for_shard.items():
        holders = sorted(set(distribution.all_ranks_for_shard[shard_id]))
        if holders != [src]:
            yield shard_id, src, holders


def _sendable(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.detach().to(device).contiguous()


# An exchange prepared (its receive tensors allocated, its sends packed): called, it
# runs the collectives and returns every shard the rank holds, by shard id.
PreparedShardExchange = Callable[[], dict[_ShardId, torch.Tensor]]


def _landed(result: dict[_ShardId, torch.Tensor], received: list[tuple[_ShardId, torch.Tensor, torch.device]]
            ) -> dict[_ShardId, torch.Tensor]:
    """``result`` with each received shard where its request wanted it."""
    for shard_id, tensor, wanted_on in received:
        result[shard_id] = tensor.to(wanted_on)
    return result


def _prepare_broadcasts(
    result: dict[_ShardId, torch.Tensor], unloaded_shards: dict[_ShardId, ShardedTensor],
    distribution: ShardDistribution, group: Group,
) -> PreparedShardExchange:
    """One broadcast per shared shard, from its loader to the whole group; the tensors
    this rank sends (on the group's device, contiguous) and receives into made now."""
    steps: list[tuple[int, _ShardId, torch.Tensor | None]] = []  # (src, shard id, what it sends or lands in)
    received: list[tuple[_ShardId, torch.Tensor, torch.device]] = []
    others: list[ShardedTensor] = []
    for shard_id, src, _ in _shared_shards(distribution):
        if src == group.rank:
            steps.append((src, shard_id, _sendable(result[shard_id], group.device)))
        elif shard_id in unloaded_shards:
            tensor, wanted_on = _get_empty_tensor_for_exchange(shard_id, unloaded_shards, result, group.device)
            steps.append((src, shard_id, tensor))
            received.append((shard_id, tensor, wanted_on))
        else:
            others.append(distribution.shard_to_metadata[shard_id])
            steps.append((src, shard_id, None))
    scratch = _Scratch(others, group.device)

    def run() -> dict[_ShardId, torch.Tensor]:
        for src, shard_id, tensor in steps:
            if tensor is None:
                tensor = scratch.view(distribution.shard_to_metadata[shard_id])
            group.broadcast_tensor(tensor, src)
        return _landed(result, received)

    return run


def _prepare_point_to_point(
    result: dict[_ShardId, torch.Tensor], unloaded_shards: dict[_ShardId, ShardedTensor],
    distribution: ShardDistribution, group: Group,
) -> PreparedShardExchange:
    """Each shared shard goes from its loader to the ranks that hold it and to no other,
    all in one batched exchange (``Group.prepare_exchange``: packed and allocated now)."""
    sends: dict[int, list[torch.Tensor]] = defaultdict(list)
    receives: dict[int, list[torch.Tensor]] = defaultdict(list)
    received: list[tuple[_ShardId, torch.Tensor, torch.device]] = []
    for shard_id, src, holders in _shared_shards(distribution):
        if src == group.rank:
            tensor = _sendable(result[shard_id], group.device)
            for peer in holders:
                if peer != src:
                    sends[peer].append(tensor)
        elif group.rank in holders:
            tensor, wanted_on = _get_empty_tensor_for_exchange(shard_id, unloaded_shards, result, group.device)
            receives[src].append(tensor)
            received.append((shard_id, tensor, wanted_on))
    prepared = group.prepare_exchange(dict(sends), dict(receives))

    def run() -> dict[_ShardId, torch.Tensor]:
        group.run_exchange(prepared)
        return _landed(result, received)

    return run


def prepare_exchange_by_distribution(
    loaded_tensors: dict[_ShardId, torch.Tensor],
    unloaded_shards: dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution | None,
    parallelization_group: dist.ProcessGroup | None = None,
    exchange_algo: str = "broadcast",
) -> PreparedShardExchange:
    """``exchange_by_distribution``'s local part, no collective: allocates what this
    rank receives into and stages what it sends (packed, point to point). A caller runs it
    before agreeing with the other ranks (``protocol.stage.run_stage``), so a rank that
    cannot (out of memory) fails every rank at once instead of leaving them waiting in
    the exchange; calling the result runs the exchange (collective)."""
    if exchange_algo not in EXCHANGE_ALGOS:
        raise ValueError(f"Unknown exchange_algo {exchange_algo!r}; choose one of {EXCHANGE_ALGOS}")
    if shard_distribution is None:
        raise CheckpointingException(
            "exchange_by_distribution needs the distribution determine_main_replica_uniform_distribution "
            "computed for this group (it is None only for a group of one rank, which needs no exchange)"
        )
    prepare = _prepare_broadcasts if exchange_algo == "broadcast" else _prepare_point_to_point
    with torch.no_grad():
        run = prepare(dict(loaded_tensors), unloaded_shards, shard_distribution, Group(parallelization_group))

    def exchange() -> dict[_ShardId, torch.Tensor]:
        with torch.no_grad():
            return run()

    return exchange



def exchange_loaded_objects_gather_object(
    loaded_objects: dict[_ShardId, Any], parallelization_group: dist.ProcessGroup | None = None
) -> dict[_ShardId, Any]:
    """Collective: every rank's loaded objects on every rank of the group (the world by
    default, as in Megatron: an object's main replica may be outside a data-parallel
    group).

    Raises:
        CheckpointingException: when two ranks loaded the same object (both held it as
            the main replica: set replica_id to 0 on exactly one).
    """
    per_rank = Group(parallelization_group).all_gather_object(loaded_objects)
    merged: dict[_ShardId, Any] = {}
    duplicated = []
    for rank_objects in per_rank:
        duplicated.extend(k for k in rank_objects if k in merged)
        merged.update(rank_objects)
    if duplicated:
        raise CheckpointingException(
            f"Sharded objects loaded by more than one rank: {sorted(duplicated, key=str)[:5]}; exactly one "
            "rank must hold each object as its main replica (replica_id 0)"
        )
    return merged
