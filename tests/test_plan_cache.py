"""A save that keeps its plan (``ZarrSaveShardedStrategy(cache_plan=True)``, or
``FullyParallelSaveStrategyWrapper(..., do_cache_distribution=True)`` around it): while
every rank's structure is unchanged the plan stage sends no shard records and the
coordinator neither validates nor plans; a structure that changed on any rank plans in
full; what belongs to each save (its id, its data, the common state's comparison) is
never cached. Real gloo groups of 2 and 4 ranks (``protocol.plan_cache``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from shardstore import ShardedObject, ShardedTensor, load, save
from shardstore.errors import CheckpointingException
from shardstore.format.integrity import verify
from shardstore.format.records import read_commit_record
from shardstore.mapping import ShardedTensorFactory
from shardstore.protocol.collectives import Group
from shardstore.stores.locations import open_location
from shardstore.strategies.async_utils import AsyncCallsQueue
from shardstore.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed
from tests.test_collective_counts import counting

COLS = 6
CHUNK_BYTES = 2 * COLS * 4  # two rows of float32: a flattened chunk straddles ranks


def state_dict(rank: int, world: int, step: int, private_len: int = 3, empty: bool = False) -> dict:
    """A trainer's state dict at ``step`` (its values change with the step, its
    structure does not): a tensor split over the ranks, a replicated one, a flattened
    range cut unevenly, a tensor only this rank holds (``private_len`` long), an object
    and common state."""
    rows = 2 * world

    def fill(shape: tuple[int, ...], base: float) -> torch.Tensor:
        if empty:
            return torch.zeros(shape)
        return torch.arange(float(torch.Size(shape).numel())).reshape(shape) + base

    volume = rows * COLS
    cuts = [0] + [r * (volume // world) + r % 2 for r in range(1, world)] + [volume]
    flat = fill((rows, COLS), 100.0 * step).flatten()[cuts[rank]:cuts[rank + 1]].clone()
    return {
        "model": {
            "split": ShardedTensor.from_rank_offsets("model/split", fill((2, COLS), 10.0 * step + rank), (0, rank, world)),
            "replicated": ShardedTensor.from_rank_offsets("model/replicated", fill((COLS,), step), replica_id=rank),
            "private": ShardedTensor.from_rank_offsets(f"private/{rank}", fill((private_len,), step + rank)),
        },
        "optimizer": {"exp_avg": ShardedTensor.from_rank_offsets_flat(
            "optimizer/exp_avg", flat, (rows, COLS), flattened_range=slice(cuts[rank], cuts[rank + 1]))},
        "rng": ShardedObject("rng", {"seed": rank, "step": step}, (world,), (rank,)),
        "iteration": step,
    }


class Traffic:
    """What this rank sent to the coordinator in gathers, and how often the coordinator planned."""

    def __init__(self) -> None:
        self.gathered: list[bytes] = []
        self.plans = 0

    @property
    def record_bytes(self) -> int:
        """Bytes of the gathered messages that held shard records."""
        return sum(len(g) for g in self.gathered if b"ShardRecord" in g)

    @property
    def gathered_bytes(self) -> int:
        return sum(len(g) for g in self.gathered)


@contextmanager
def traffic() -> Iterator[Traffic]:
    """Records every gathered object (pickled, as it travels) and every call of the save planner."""
    import shardstore.engine.zarr_strategies as zarr_strategy  # where the strategy looks it up

    seen = Traffic()
    gather, planner = Group.gather_to_answer, zarr_strategy.plan_save

    def recorded_gather(self: Group, message: bytes, *args: Any, **kwargs: Any) -> Any:
        seen.gathered.append(message)
        return gather(self, message, *args, **kwargs)

    def counted_planner(*args: Any, **kwargs: Any) -> Any:
        seen.plans += 1
        return planner(*args, **kwargs)

    Group.gather_to_answer, zarr_strategy.plan_save = recorded_gather, counted_planner
    try:
        yield seen
    finally:
        Group.gather_to_answer, zarr_strategy.plan_save = gather, planner


def loaded(rank: int, world: int, ckpt: str, private_len: int = 3) -> dict:
    """What ``ckpt`` gives back for this rank's state dict."""
    out = load(state_dict(rank, world, 0, private_len, empty=True), ckpt)
    return {"split": out["model"]["split"], "replicated": out["model"]["replicated"],
            "private": out["model"]["private"], "exp_avg": out["optimizer"]["exp_avg"], "rng": out["rng"],
            "iteration": out["iteration"]}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def expected(rank: int, world: int, step: int, private_len: int = 3) -> dict:
    sd = state_dict(rank, world, step, private_len)
    return {"split": sd["model"]["split"].data, "replicated": sd["model"]["replicated"].data,
            "private": sd["model"]["private"].data, "exp_avg": sd["optimizer"]["exp_avg"].data,
            "rng": sd["rng"].data, "iteration": step}


# --------------------------------------------------------------------------- workers


def save_twice_and_once_uncached(rank: int, world: int, root: str) -> dict:
    """Saves step 1 and step 2 with the cache, step 2 without; what each cost and gave."""
    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES, cache_plan=True)
    with traffic() as first:
        save(state_dict(rank, world, 1), f"{root}/first", sharded_strategy=strategy)
    with traffic() as cached:
        save(state_dict(rank, world, 2), f"{root}/cached", sharded_strategy=strategy)
    with traffic() as uncached:
        save(state_dict(rank, world, 2), f"{root}/uncached",
             sharded_strategy=ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES))
    first_loaded, cached_loaded = loaded(rank, world, f"{root}/first"), loaded(rank, world, f"{root}/cached")
    assert_same(first_loaded, expected(rank, world, 1))
    assert_same(cached_loaded, expected(rank, world, 2))
    assert_same(cached_loaded, loaded(rank, world, f"{root}/uncached"))
    return {
        "record_bytes": [t.record_bytes for t in (first, cached, uncached)],
        "gathered_bytes": [t.gathered_bytes for t in (first, cached, uncached)],
        "plans": [t.plans for t in (first, cached, uncached)],
        "cache": (strategy.plan_cache.planned, strategy.plan_cache.reused),
    }


def save_with_one_rank_changed(rank: int, world: int, root: str) -> dict:
    """Under the cache, the last rank's private tensor grows between the saves."""
    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES, cache_plan=True)
    save(state_dict(rank, world, 1), f"{root}/first", sharded_strategy=strategy)
    private_len = 5 if rank == world - 1 else 3
    with traffic() as changed:
        save(state_dict(rank, world, 2, private_len), f"{root}/changed", sharded_strategy=strategy)
    with traffic() as again:
        save(state_dict(rank, world, 3, private_len), f"{root}/again", sharded_strategy=strategy)
    assert_same(loaded(rank, world, f"{root}/changed", private_len), expected(rank, world, 2, private_len))
    assert_same(loaded(rank, world, f"{root}/again", private_len), expected(rank, world, 3, private_len))
    return {"plans": [changed.plans, again.plans], "record_bytes": [changed.record_bytes, again.record_bytes],
            "cache": (strategy.plan_cache.planned, strategy.plan_cache.reused)}


def save_after_one_rank_cleared(rank: int, world: int, root: str) -> dict:
    """Only the last rank clears its cache between the saves (as a rank whose process
    was replaced would hold none)."""
    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES, cache_plan=True)
    save(state_dict(rank, world, 1), f"{root}/first", sharded_strategy=strategy)
    if rank == world - 1:
        strategy.plan_cache.clear()
    with traffic() as cleared:
        save(state_dict(rank, world, 2), f"{root}/cleared", sharded_strategy=strategy)
    with traffic() as again:
        save(state_dict(rank, world, 3), f"{root}/again", sharded_strategy=strategy)
    assert_same(loaded(rank, world, f"{root}/cleared"), expected(rank, world, 2))
    assert_same(loaded(rank, world, f"{root}/again"), expected(rank, world, 3))
    return {"plans": [cleared.plans, again.plans], "record_bytes": [cleared.record_bytes, again.record_bytes],
            "cache": (strategy.plan_cache.planned, strategy.plan_cache.reused)}


def save_with_the_cache_on_some_ranks(rank: int, world: int, root: str, cached_rank: int) -> str:
    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES, cache_plan=rank == cached_rank)
    with pytest.raises(CheckpointingException, match="The ranks disagree on the plan cache") as refused:
        save(state_dict(rank, world, 1), f"{root}/refused", sharded_strategy=strategy)
    return str(refused.value)


def save_without_cache(rank: int, world: int, root: str) -> list[int]:
    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES)
    sent = []
    for step in (1, 2):
        with traffic() as t:
            save(state_dict(rank, world, step), f"{root}/{step}", sharded_strategy=strategy)
        sent.append(t.record_bytes)
        assert t.record_bytes > 0
    assert strategy.plan_cache is None
    return sent


def async_saves_with_cache(rank: int, world: int, root: str) -> tuple[int, int]:
    strategy = FullyParallelSaveStrategyWrapper(
        ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES), do_cache_distribution=True)
    queue = AsyncCallsQueue()
    for step in (1, 2, 3):
        request = save(state_dict(rank, world, step), f"{root}/{step}", sharded_strategy=strategy,
                       async_sharded_save=True)
        queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    for step in (1, 2, 3):
        assert_same(loaded(rank, world, f"{root}/{step}"), expected(rank, world, step))
    return strategy.plan_cache.planned, strategy.plan_cache.reused


def count_collectives(rank: int, world: int, root: str) -> dict[str, int]:
    cached = ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES, cache_plan=True)
    with counting() as first:
        save(state_dict(rank, world, 1), f"{root}/first", sharded_strategy=cached)
    with counting() as reused:
        save(state_dict(rank, world, 2), f"{root}/reused", sharded_strategy=cached)
    with counting() as uncached:
        save(state_dict(rank, world, 2), f"{root}/uncached",
             sharded_strategy=ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES))
    with counting() as replanned:
        save(state_dict(rank, world, 3, private_len=4), f"{root}/replanned", sharded_strategy=cached)
    return {name: sum(c.collectives.values()) for name, c in
            (("first", first), ("reused", reused), ("uncached", uncached), ("replanned", replanned))}


def save_to_other_limits_and_settings(rank: int, world: int, root: str, long_root: str) -> dict:
    """A longer path (other name limits that still hold the plan's names) reuses; a
    target too short for them plans in full (and is refused); other planner settings
    plan again."""
    from shardstore.stores.base import NameLimits
    from shardstore.stores.local import LocalStore

    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES, cache_plan=True)
    plans, sent = [], []
    for step, where in ((1, f"{root}/a"), (2, f"{long_root}/b")):
        with traffic() as t:
            save(state_dict(rank, world, step), where, sharded_strategy=strategy)
        plans.append(t.plans)
        sent.append(t.record_bytes)
    limits = LocalStore.name_limits
    LocalStore.name_limits = property(lambda self: NameLimits(255, 12, "a test's short limit"))
    try:
        with traffic() as t:
            save(state_dict(rank, world, 3), f"{root}/c", sharded_strategy=strategy)
        refused = "no error"
    except CheckpointingException as exc:
        refused = str(exc)
    finally:
        LocalStore.name_limits = limits
    plans.append(t.plans)
    sent.append(t.record_bytes)
    strategy.max_chunk_bytes = 4 * CHUNK_BYTES
    with traffic() as t:
        save(state_dict(rank, world, 4), f"{root}/d", sharded_strategy=strategy)
    plans.append(t.plans)
    for step, where in ((2, f"{long_root}/b"), (4, f"{root}/d")):
        assert_same(loaded(rank, world, where), expected(rank, world, step))
    return {"plans": plans, "record_bytes": sent, "refused": refused}


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def common_state_compared_under_cache(rank: int, world: int, root: str) -> list[str]:
    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES, cache_plan=True)
    save(state_dict(rank, world, 1), f"{root}/first", sharded_strategy=strategy)
    handler = _Messages()
    logging.getLogger("shardstore").addHandler(handler)
    try:
        sd = state_dict(rank, world, 2)
        sd["timer"] = float(rank)  # differs from rank 0's
        save(sd, f"{root}/second", sharded_strategy=strategy)
    finally:
        logging.getLogger("shardstore").removeHandler(handler)
    assert strategy.plan_cache.reused == 1
    return [m for m in handler.messages if "differs from rank 0" in m or "difference in the common state" in m]


def _failing_build(key: str, data: torch.Tensor, replica_id: Any, flattened_range: Any) -> Any:
    raise ValueError("factory broke")


def failure_under_cache(rank: int, world: int, root: str) -> tuple[str, tuple[int, int]]:
    """Rank 1 fails before the plan while a plan is cached: every rank raises the same
    error, nothing is saved, and the next save still reuses the plan."""
    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES, cache_plan=True)
    save(state_dict(rank, world, 1), f"{root}/first", sharded_strategy=strategy)
    sd = state_dict(rank, world, 2)
    if rank == 1:
        sd["broken"] = ShardedTensorFactory("broken", torch.zeros(2), _failing_build, lambda x: x)
    try:
        save(sd, f"{root}/failed", sharded_strategy=strategy)
        message = "no error"
    except CheckpointingException as exc:
        message = str(exc)
    save(state_dict(rank, world, 3), f"{root}/third", sharded_strategy=strategy)
    assert_same(loaded(rank, world, f"{root}/third"), expected(rank, world, 3))
    return message, (strategy.plan_cache.planned, strategy.plan_cache.reused)


def save_after_swapping_the_dtype(rank: int, world: int, root: str) -> dict:
    """Saves a state dict kept across steps (its ShardedTensors wrap the parameters),
    swaps each parameter's ``.data`` to bfloat16 and saves again under the cached plan;
    what the second checkpoint gives back and what the cache did."""
    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=CHUNK_BYTES, cache_plan=True)
    rows = 2 * world
    split = torch.nn.Parameter(torch.arange(2.0 * COLS).reshape(2, COLS) / 3 + rank)
    volume = rows * COLS
    cuts = [0] + [r * (volume // world) + r % 2 for r in range(1, world)] + [volume]  # uneven: chunks straddle
    cut = slice(cuts[rank], cuts[rank + 1])
    flat = torch.nn.Parameter(torch.arange(float(volume))[cut] / 7)
    kept = {
        "split": ShardedTensor.from_rank_offsets("split", split, (0, rank, world)),
        "flat": ShardedTensor.from_rank_offsets_flat("flat", flat, (rows, COLS), flattened_range=cut),
    }
    save(kept, f"{root}/float32", sharded_strategy=strategy)
    for parameter in (split, flat):
        parameter.data = parameter.data.to(torch.bfloat16)
    save(kept, f"{root}/bfloat16", sharded_strategy=strategy)
    request = {
        "split": ShardedTensor.from_rank_offsets("split", torch.zeros(2, COLS, dtype=torch.bfloat16), (0, rank, world)),
        "flat": ShardedTensor.from_rank_offsets_flat(
            "flat", torch.zeros(cut.stop - cut.start, dtype=torch.bfloat16), (rows, COLS), flattened_range=cut),
    }
    out = load(request, f"{root}/bfloat16")
    return {
        "exact": [torch.equal(out["split"], split.data), torch.equal(out["flat"], flat.data)],
        "cache": (strategy.plan_cache.planned, strategy.plan_cache.reused),
    }


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 4])
def test_an_unchanged_structure_reuses_the_plan_and_sends_no_shard_records(tmp_path: Path, world: int) -> None:
    results = run_distributed(save_twice_and_once_uncached, world, str(tmp_path))
    for rank, r in enumerate(results):
        first, cached, uncached = r["record_bytes"]
        assert first > 0 and uncached > 0, r
        assert cached == 0, r  # no shard record left this rank
        assert r["gathered_bytes"][1] < r["gathered_bytes"][2], r
        assert r["cache"] == (1, 1), r
        assert r["plans"] == ([1, 0, 1] if rank == 0 else [0, 0, 0]), r  # only the coordinator plans
    cached, uncached = (read_commit_record(open_location(tmp_path / d)) for d in ("cached", "uncached"))
    # the same chunk grid and every chunk's crc32c; the files' identities (chunk_etags) are each save's own
    assert {k: replace(a, chunk_etags=None) for k, a in cached.arrays.items()} == {
        k: replace(a, chunk_etags=None) for k, a in uncached.arrays.items()}
    assert cached.objects == uncached.objects
    assert cached.save_id != read_commit_record(open_location(tmp_path / "first")).save_id
    for d in ("first", "cached", "uncached"):
        report = verify(tmp_path / d)
        assert report.ok, str(report)


@pytest.mark.parametrize("world", [2, 4])
def test_a_structure_changed_on_one_rank_plans_in_full(tmp_path: Path, world: int) -> None:
    results = run_distributed(save_with_one_rank_changed, world, str(tmp_path))
    assert results[0]["plans"] == [1, 0]  # re-planned, then the new plan is reused
    for r in results:
        assert r["record_bytes"][0] > 0 and r["record_bytes"][1] == 0, r
        assert r["cache"] == (2, 1), r
    assert read_commit_record(open_location(tmp_path / "changed")).arrays[f"private/{world - 1}"].shape == (5,)
    for d in ("changed", "again"):
        assert verify(tmp_path / d).ok


@pytest.mark.parametrize("world", [2, 3])
def test_a_cache_cleared_on_one_rank_plans_in_full_on_every_rank(tmp_path: Path, world: int) -> None:
    """Found by review: a rank holding no plan took the full plan's round trip while the
    others took the check's, and every later save failed until all ranks cleared."""
    results = run_distributed(save_after_one_rank_cleared, world, str(tmp_path))
    assert results[0]["plans"] == [1, 0]  # re-planned for every rank, then reused
    for r in results:
        assert r["record_bytes"][0] > 0 and r["record_bytes"][1] == 0, r
        assert r["cache"] == (2, 1), r
    for d in ("cleared", "again"):
        assert verify(tmp_path / d).ok


@pytest.mark.parametrize("cached_rank", [0, 1])
def test_a_cache_on_some_ranks_only_is_refused_on_every_rank_by_name(tmp_path: Path, cached_rank: int) -> None:
    """Found by review: where the coordinator kept no plan cache and another rank did,
    the first save failed with a TypeError from unpacking the other rank's vote."""
    messages = run_distributed(save_with_the_cache_on_some_ranks, 2, str(tmp_path), cached_rank)
    assert all("cache_plan or do_cache_distribution" in m for m in messages), messages
    assert not (tmp_path / "refused").exists()


def test_without_the_cache_every_save_sends_its_records(tmp_path: Path) -> None:
    sent = run_distributed(save_without_cache, 2, str(tmp_path))
    assert all(first == second > 0 for first, second in sent), sent


def test_async_saves_reuse_the_plan_through_the_wrapper(tmp_path: Path) -> None:
    results = run_distributed(async_saves_with_cache, 2, str(tmp_path))
    assert results == [(1, 2), (1, 2)]
    for step in (1, 2, 3):
        assert verify(tmp_path / str(step)).ok


@pytest.mark.parametrize("world", [2, 4])
def test_a_cached_save_makes_no_more_collectives_than_an_uncached_one(tmp_path: Path, world: int) -> None:
    for counts in run_distributed(count_collectives, world, str(tmp_path)):
        assert counts["reused"] <= counts["uncached"], counts
        assert counts["replanned"] == counts["uncached"] + 2, counts  # one more gather and scatter
        assert counts["first"] == counts["uncached"] + 2, counts  # the check, holding no plan yet


def test_a_target_too_short_for_the_names_or_new_planner_settings_plan_again(tmp_path: Path) -> None:
    long_root = tmp_path / ("x" * 120)  # other name limits, long enough for every file
    results = run_distributed(save_to_other_limits_and_settings, 2, str(tmp_path), str(long_root))
    assert results[0]["plans"] == [1, 0, 0, 1], results  # the full check refuses c before planning
    for r in results:
        assert r["record_bytes"][1] == 0 and r["record_bytes"][2] > 0, r  # b reused; c gathered in full
        assert "cannot be stored" in r["refused"] and "short limit" in r["refused"], r
    assert not (tmp_path / "c").exists()
    b, d = (read_commit_record(open_location(p)) for p in (long_root / "b", tmp_path / "d"))
    assert b.arrays["optimizer/exp_avg"].chunk_shape != d.arrays["optimizer/exp_avg"].chunk_shape


def test_the_common_state_is_still_compared_under_the_cache(tmp_path: Path) -> None:
    warnings = run_distributed(common_state_compared_under_cache, 2, str(tmp_path))
    assert any("timer" in m for m in warnings[1]), warnings


def test_a_failure_under_the_cache_fails_every_rank_and_keeps_the_plan(tmp_path: Path) -> None:
    results = run_distributed(failure_under_cache, 2, str(tmp_path))
    assert results[0][0] == results[1][0] and "factory broke" in results[0][0], results
    assert all(counts == (1, 1) for _, counts in results), results  # the third save reused the first's plan
    assert not (tmp_path / "failed").exists()


def test_the_wrapper_turns_on_the_cache_of_a_copy_of_shardstores_strategy() -> None:
    """A copy: Megatron wraps the process-wide default strategy, which later unwrapped
    saves use too (found by review: the wrapper switched the default's cache on)."""
    strategy = ZarrSaveShardedStrategy(fully_parallel=False)
    wrapper = FullyParallelSaveStrategyWrapper(strategy, do_cache_distribution=True)
    assert wrapper.plan_cache is not None and wrapper.base_strategy.fully_parallel
    assert strategy.plan_cache is None and not strategy.cache_plan and not strategy.fully_parallel
    assert FullyParallelSaveStrategyWrapper(ZarrSaveShardedStrategy()).plan_cache is None
    cached = ZarrSaveShardedStrategy(cache_plan=True)
    assert FullyParallelSaveStrategyWrapper(cached).plan_cache not in (None, cached.plan_cache)


def test_a_single_process_reuses_its_plan(tmp_path: Path) -> None:
    strategy = ZarrSaveShardedStrategy(cache_plan=True)
    for step in (1, 2):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(step)))}, tmp_path / str(step),
             sharded_strategy=strategy)
    assert (strategy.plan_cache.planned, strategy.plan_cache.reused) == (1, 1)
    assert torch.equal(load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, tmp_path / "2")["w"],
                       torch.full((4,), 2.0))
    # each record carries its own commit time, not the reused plan's (found by review)
    first, second = (read_commit_record(open_location(tmp_path / s)) for s in ("1", "2"))
    assert second.created > first.created and second.save_id != first.save_id


def test_a_dtype_swapped_under_the_cached_plan_is_saved_as_held(tmp_path: Path) -> None:
    """Issue 41.7b: ``p.data = p.data.to(torch.bfloat16)`` under a kept ShardedTensor
    (whose declared dtype is still float32) plans anew and saves bfloat16, exactly."""
    for result in run_distributed(save_after_swapping_the_dtype, 2, str(tmp_path)):
        assert result == {"exact": [True, True], "cache": (2, 0)}, result
    arrays = read_commit_record(open_location(tmp_path / "bfloat16")).arrays
    assert {key: arrays[key].dtype for key in ("split", "flat")} == {"split": "bfloat16", "flat": "bfloat16"}
    assert verify(tmp_path / "bfloat16").ok
