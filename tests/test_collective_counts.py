"""How many collectives and walks of the state dict one save and one load make (issue 24.4).

A **collective** is one call, made by shardstore, of a ``torch.distributed`` function
that talks to other ranks (``COUNTED_COLLECTIVES``: the object collectives, tensor
collectives, barriers and one batch of point-to-point transfers; ``isend``/``irecv``
are not wrapped, as ``P2POp`` checks their identity). Calls made inside such a
function (``all_gather_object`` runs two ``all_gather``s, and so do ``Group``'s own
object collectives, ``GROUP_OBJECT_COLLECTIVES``, which wait within a budget) are part
of it, not counted again: what is counted is the round trips shardstore asks for.

A **walk** is one outermost call of a function that visits every leaf of the nested
container it is given (``WALKERS``: the walkers of ``shardstore.dict_utils``, the
sharded-class search of the common state, the factory merge and the DTensor
conversion), whatever part of the state dict it walks (the whole request, its
sharded part, its common part, the loaded result). Calls made inside a walk (its
recursion, or a walker its callback calls) belong to that walk. Loops over a flat
list of items already extracted are not walks.

Counted on every rank of a 2-rank gloo group (the largest count of any rank is
reported), for a state dict that holds a tensor split between the ranks, a replicated
one, a flattened range whose chunk straddles the two ranks, a factory, a sharded
object, a non-persistent value and common state.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardstore import ShardedObject, ShardedTensor, load, save
from shardstore.mapping import LocalNonpersistentObject, ShardedTensorFactory
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed

COUNTED_COLLECTIVES = (
    "all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list", "all_reduce",
    "all_gather", "gather", "scatter", "broadcast", "reduce", "barrier", "batch_isend_irecv", "send", "recv",
)
GROUP_OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "scatter_object", "broadcast_object")
WALKERS = {
    "shardstore.dict_utils": (
        "extract_matching_values", "nested_values", "nested_items_iter", "dict_map", "dict_map_with_key",
        "dict_list_map_inplace", "dict_list_map_outplace", "merge", "flatten",
    ),
    "shardstore.utils": ("sharded_values_in_common", "holds_sharded_class", "local_sharded_items", "sharded_tensor_slots"),
    "shardstore.mapping": ("apply_factory_merges",),
    "shardstore.inputs.dtensors": ("with_dtensors_converted",),
}
# Today's counts (issue 24.4 targets 6 collectives and 3 walks each). The walks: one
# of the request (``dict_utils.flatten``: conversion, factories, non-persistent values,
# the split), then the strategies' own (a save: the objects, its tensors are the ones
# the pipeline planned, issue 43.1; a load: the objects and the sharded part, filled in
# place); the result is rebuilt from the flat list (``dict_utils.nest``), not walked again.
MAX_SAVE_COLLECTIVES = 6
MAX_SAVE_WALKS = 2
MAX_LOAD_COLLECTIVES = 4
MAX_LOAD_WALKS = 3

ROWS, COLS = 8, 6


class Counts:
    """What one rank counted: collectives by name, and the walks, by walker."""

    def __init__(self) -> None:
        self.collectives: Counter[str] = Counter()
        self.walks: Counter[str] = Counter()
        self._depth = 0
        self._collective_depth = 0

    def count_collective(self, name: str, fn: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._collective_depth == 0:
                self.collectives[name] += 1
            self._collective_depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._collective_depth -= 1

        return counted

    def count_walk(self, name: str, fn: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.walks[name] += 1
            self._depth += 1
            try:
                result = fn(*args, **kwargs)
                if hasattr(result, "__next__"):  # a generator walks when consumed
                    return list(result)
                return result
            finally:
                self._depth -= 1

        return counted


@contextmanager
def counting() -> Iterator[Counts]:
    """Counts the collectives and walks made inside the block, in this process: every
    module's binding of a counted function is replaced (``from x import f`` copies it)."""
    counts = Counts()
    originals: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, wrapped: Any) -> None:
        originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapped)

    for name in COUNTED_COLLECTIVES:
        patch(dist, name, counts.count_collective(name, getattr(dist, name)))
    from shardstore.protocol.collectives import Group

    for name in GROUP_OBJECT_COLLECTIVES:
        patch(Group, name, counts.count_collective(name, getattr(Group, name)))
    walkers = {getattr(sys.modules[m], n): n for m, names in WALKERS.items() for n in names}
    for module in [m for k, m in list(sys.modules.items()) if k.startswith("shardstore") and m is not None]:
        for attr, value in list(vars(module).items()):
            if callable(value) and value in walkers:
                patch(module, attr, counts.count_walk(walkers[value], value))
    try:
        yield counts
    finally:
        for owner, name, value in reversed(originals):
            setattr(owner, name, value)


def _build(key: str, data: torch.Tensor, replica_id: Any, flattened_range: Any) -> dict:
    return {"halves": [ShardedTensor.from_rank_offsets(f"{key}/h{i}", h, replica_id=replica_id)
                       for i, h in enumerate(data.chunk(2, 1))]}


def _merge(sub: dict) -> torch.Tensor:
    return torch.cat(sub["halves"], 1)


def state_dict(rank: int, world: int, empty: bool) -> dict:
    """Every kind of entry a trainer's state dict holds, this rank's part of each."""
    fill = torch.zeros if empty else (lambda *s: torch.arange(float(torch.Size(s).numel())).reshape(s) + rank)
    flat_block = torch.arange(float(ROWS * COLS)).reshape(ROWS, COLS)
    cut = [0, 21, ROWS * COLS]  # mid-row: a chunk of rows straddles the two ranks
    flat = flat_block.flatten()[cut[rank]:cut[rank + 1]].clone()
    replicated = torch.arange(float(COLS))
    return {
        "model": {
            "split": ShardedTensor.from_rank_offsets("model/split", fill(ROWS // world, COLS), (0, rank, world)),
            "replicated": ShardedTensor.from_rank_offsets(
                "model/replicated", torch.zeros(COLS) if empty else replicated, replica_id=rank),
            "factory": ShardedTensorFactory(
                "model/factory", torch.zeros(2, 4) if empty else torch.ones(2, 4), _build, _merge, replica_id=rank),
        },
        "optimizer": [{"exp_avg": ShardedTensor.from_rank_offsets_flat(
            "optimizer/exp_avg", torch.zeros_like(flat) if empty else flat, (ROWS, COLS),
            flattened_range=slice(cut[rank], cut[rank + 1]))}],
        "rng": ShardedObject("rng", {"seed": rank}, (world,), (rank,)),
        "timers": LocalNonpersistentObject(rank),
        "iteration": 7,
        "args": {"lr": 0.1, "layers": [1, 2]},
    }


def save_counted(rank: int, world: int, ckpt: str) -> tuple[dict, dict]:
    sharded = state_dict(rank, world, empty=False)
    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=2 * COLS * 4)  # 2-row chunks: one straddles
    with counting() as counts:
        save(sharded, ckpt, sharded_strategy=strategy)
    return dict(counts.collectives), dict(counts.walks)


def load_counted(rank: int, world: int, ckpt: str) -> tuple[dict, dict]:
    request = state_dict(rank, world, empty=True)
    with counting() as counts:
        loaded = load(request, ckpt)
    expected = state_dict(rank, world, empty=False)
    assert torch.equal(loaded["model"]["split"], expected["model"]["split"].data)
    assert torch.equal(loaded["optimizer"][0]["exp_avg"], expected["optimizer"][0]["exp_avg"].data)
    assert torch.equal(loaded["model"]["factory"], torch.ones(2, 4))
    assert loaded["rng"] == {"seed": rank} and loaded["timers"] == rank and loaded["iteration"] == 7
    return dict(counts.collectives), dict(counts.walks)


def _most(results: list[tuple[dict, dict]]) -> tuple[int, int, list[tuple[dict, dict]]]:
    return max(sum(c.values()) for c, _ in results), max(sum(w.values()) for _, w in results), results


def test_counting_sees_collectives_and_walks() -> None:
    """The counters themselves: a walker called inside another is one walk, a
    generator counts once, and a collective made through torch.distributed counts."""
    from shardstore.dict_utils import dict_list_map_inplace, nested_values
    from shardstore.protocol.collectives import Group

    with counting() as counts:
        import shardstore.dict_utils as du

        du.dict_list_map_inplace(lambda x: sum(du.nested_values({"a": [x]})), {"a": [1, 2], "b": {"c": 3}})
        list(du.nested_values({"a": 1}))
        Group().barrier()  # no process group: no collective
    assert counts.walks == Counter({"dict_list_map_inplace": 1, "nested_values": 1})
    assert counts.collectives == Counter()
    assert du.dict_list_map_inplace is dict_list_map_inplace and du.nested_values is nested_values


def test_a_save_and_a_load_stay_within_their_collectives_and_walks(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    save_collectives, save_walks, saved = _most(run_distributed(save_counted, 2, ckpt))
    load_collectives, load_walks, loaded = _most(run_distributed(load_counted, 2, ckpt))
    assert save_collectives <= MAX_SAVE_COLLECTIVES, saved
    assert save_walks <= MAX_SAVE_WALKS, saved
    assert load_collectives <= MAX_LOAD_COLLECTIVES, loaded
    assert load_walks <= MAX_LOAD_WALKS, loaded
    assert save_collectives > 0 and load_collectives > 0  # the counters saw the stages


def save_with_failing_common_state(rank: int, world: int, ckpt: str) -> str:
    """The coordinator's common.pt write fails; returns what this rank raised."""
    from shardstore import CheckpointingException
    from shardstore.strategies.common import TorchCommonSaveStrategy

    def fail(self: Any, common_state_dict: Any, checkpoint_dir: Any) -> None:
        raise OSError("No space left on device")

    TorchCommonSaveStrategy.save_common = fail  # this worker process only
    try:
        save(state_dict(rank, world, empty=False), ckpt)
    except CheckpointingException as exc:
        return str(exc)
    return "no error"


def test_a_failed_common_state_fails_every_rank_in_the_staging_stage(tmp_path: Path) -> None:
    """The common stage has no collective of its own: the staging stage tells every rank."""
    errors = run_distributed(save_with_failing_common_state, 2, str(tmp_path / "ckpt"))
    assert errors[0] == errors[1], errors
    assert "failed on rank(s) 0" in errors[0] and "Saving the common state" in errors[0], errors
    assert "No space left on device" in errors[0], errors
    assert not (tmp_path / "ckpt").exists()
