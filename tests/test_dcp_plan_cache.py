"""``dcp.save`` with DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``,
as NeMo-RL and xtuner turn on) through ``ShardstoreWriter``.

From the second save on, a rank whose plan did not change sends DCP's coordinator an
empty ``SavePlan(usable=False)`` and gets its previous save's plan back from DCP's
class-level cache, with that save's ``RankPart``. The writer then plans the save in
``write_data``, every rank together, from the items DCP cached: each save is a new
checkpoint with its own staging area and commit record, bit-exact. Real gloo ranks with
an FSDP2 model and AdamW, steps of training between saves.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException as DcpFailure
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

import shardstore
from shardstore import ShardstoreReader, ShardstoreWriter
from tests import fsdp_models as fm
from tests.dist import run_distributed

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

STEPS = 3


class RecordingWriter(ShardstoreWriter):
    """A ``ShardstoreWriter`` that notes, on the coordinator, which plans DCP's plan
    cache sent it as new (``usable``) at each save."""

    usable: list[list[bool]] = []
    plans: list[str] = []  # on every rank, per save: "planned" (by the coordinator) or "reused"

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        RecordingWriter.usable.append([plan.usable for plan in plans])
        return super().prepare_global_plan(plans)

    def _this_saves_part(self, plan: SavePlan, planner: SavePlanner) -> Any:
        part = super()._this_saves_part(plan, planner)
        RecordingWriter.plans.append("reused" if part.plan_id in RecordingWriter._seen else "planned")
        RecordingWriter._seen.add(part.plan_id)
        return part

    _seen: set[str] = set()


def _state(model: Any, optimizer: Any, step: int, rank: int, extra_on_rank1: bool) -> dict[str, Any]:
    """The trainer's state: FSDP2 DTensors, AdamW's moments and steps, a replicated plain
    tensor large enough to be an array of its own, a value; with ``extra_on_rank1``, one
    more tensor that rank 1 alone holds (its plan changes, the others' do not)."""
    state: dict[str, Any] = {**fm.state_dict(model, optimizer), "table": torch.full((64, 8), float(step)),
                             "step": step}
    if extra_on_rank1 and rank == 1:
        state["rank1_only"] = torch.arange(512, dtype=torch.float32) + step
    return state


def save_steps_with_plan_caching(rank: int, world: int, root: str, shard_bytes: int | None) -> list:
    """``STEPS`` trained steps, each saved with plan caching into a checkpoint of its
    own; the third adds a tensor on rank 1 only. Every step loaded back and compared."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = fm.build(world, seed=3)
    writer = RecordingWriter(None, shard_bytes=shard_bytes)  # one writer, reset by each checkpoint_id
    saved = []
    for step in range(STEPS):
        fm.train_step(model, optimizer, step)
        state = _state(model, optimizer, step, rank, extra_on_rank1=step == 2)
        planner = DefaultSavePlanner(enable_plan_caching=True)  # a new planner each save: DCP's cache is its class's
        this_writer = writer if step != 1 else RecordingWriter(None, shard_bytes=shard_bytes)  # or a new writer
        dcp.save(state, checkpoint_id=f"{root}/step{step}", storage_writer=this_writer, planner=planner)
        saved.append(fm.full_values(state))
    assert SavePlanner._cached_all_plans or rank != 0, "DCP's plan cache was not used"
    for step in range(STEPS):
        other_model, other_optimizer = fm.build(world, seed=11)
        request = _state(other_model, other_optimizer, -1, rank, extra_on_rank1=step == 2)
        dcp.load(request, storage_reader=ShardstoreReader(f"{root}/step{step}"))
        fm.assert_same(fm.full_values(request), saved[step], f"step{step}")
    return RecordingWriter.usable


@pytest.mark.parametrize("shard_bytes", [None, 1 << 20], ids=["chunks", "shards"])
def test_saves_with_dcp_plan_caching_are_each_a_checkpoint_of_their_own(tmp_path: Path, shard_bytes: int | None) -> None:
    usable = run_distributed(save_steps_with_plan_caching, 2, str(tmp_path), shard_bytes, timeout=240)
    # the coordinator saw: every plan new, then every plan cached, then rank 1's alone new
    assert usable[0] == [[True, True], [False, False], [False, True]], usable[0]
    ids = set()
    for step in range(STEPS):
        report = shardstore.verify(tmp_path / f"step{step}")
        assert report.ok, report
        ids.add(json.loads((tmp_path / f"step{step}" / "zarr.json").read_text())["attributes"]["shardstore"]["save_id"])
    assert len(ids) == STEPS  # three saves, not one written three times


def cached_save_on_another_group(rank: int, world: int, root: str) -> str:
    """The second save's plan is made in ``write_data``, on the writer's group: a group
    of another size than ``dcp.save``'s is refused before any rank writes."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.full((64, 8), float(rank == 0)), "rank": torch.full((64, 8), float(rank))}
    own = [dist.new_group([r]) for r in range(world)][rank]
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/a", process_group=own),
             planner=DefaultSavePlanner(enable_plan_caching=True))
    with pytest.raises(DcpFailure) as refused:
        dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/b", process_group=own),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
    return str(refused.value)


def test_a_cached_save_on_a_group_not_dcps_is_refused_naming_the_argument(tmp_path: Path) -> None:
    errors = run_distributed(cached_save_on_another_group, 2, str(tmp_path))
    for error in errors:
        assert "ShardstoreWriter(process_group=...)" in error and "1 ranks where dcp.save has 2" in error, error
    assert shardstore.verify(tmp_path / "a").ok
    assert not (tmp_path / "b" / "zarr.json").exists()


@pytest.fixture
def fresh_dcp_plan_cache():
    """DCP's plan cache is class-level: each test in this process starts without one."""
    caches = (SavePlanner._cached_save_plan, SavePlanner._cached_final_save_plan, SavePlanner._cached_all_plans,
              SavePlanner._cached_global_plan, SavePlanner._cached_metadata)
    for cache in caches:
        cache.clear()
    yield
    for cache in caches:
        cache.clear()


def test_one_process_saves_with_plan_caching(tmp_path: Path, fresh_dcp_plan_cache: None) -> None:
    import torch.distributed.checkpoint as dcp

    for step in range(STEPS):
        state = {"w": torch.arange(1024, dtype=torch.float32) * step, "b": torch.tensor(step), "lr": 0.1 * step}
        dcp.save(state, storage_writer=ShardstoreWriter(tmp_path / f"step{step}"),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
    assert SavePlanner._cached_all_plans  # DCP cached, and the later saves used the cache
    for step in range(STEPS):
        loaded = {"w": torch.zeros(1024), "b": torch.tensor(-1), "lr": 0.0}
        dcp.load(loaded, storage_reader=ShardstoreReader(tmp_path / f"step{step}"))
        assert torch.equal(loaded["w"], torch.arange(1024, dtype=torch.float32) * step), step
        assert loaded["b"].item() == step and loaded["lr"] == pytest.approx(0.1 * step), loaded
        assert shardstore.verify(tmp_path / f"step{step}").ok


def test_a_dtype_change_the_plan_cache_misses_is_refused(tmp_path: Path, fresh_dcp_plan_cache: None) -> None:
    """DCP's plan cache compares names, shapes and offsets, not dtypes: a tensor that
    changed dtype arrives with its cached plan's. Refused, nothing committed."""
    import torch.distributed.checkpoint as dcp

    planner = DefaultSavePlanner(enable_plan_caching=True)
    dcp.save({"w": torch.ones(1024)}, storage_writer=ShardstoreWriter(tmp_path / "a"), planner=planner)
    with pytest.raises(DcpFailure, match=r"'w' is torch.bfloat16 and DCP's plan has it as torch.float32.*"
                                         r"enable_plan_caching=False"):
        dcp.save({"w": torch.ones(1024, dtype=torch.bfloat16)}, storage_writer=ShardstoreWriter(tmp_path / "b"),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
    assert not (tmp_path / "b" / "zarr.json").exists()


def cached_async_saves(rank: int, world: int, root: str) -> None:
    """``dcp.async_save`` with plan caching: the second save plans in ``write_data``, on
    the writer's group: on the save's thread, the writers' own group in place of the
    default one (``tools.dcp_exchange``); the group given to ``dcp.async_save`` works."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.full((64, 8), 1.0), f"r{rank}": torch.full((64, 8), float(rank))}
    for name in ("a", "b"):
        state["w"] += 1
        dcp.async_save(state, storage_writer=ShardstoreWriter(f"{root}/default-{name}"),
                       planner=DefaultSavePlanner(enable_plan_caching=True)).result(timeout=60)
    background = dist.new_group(backend="gloo")
    for name in ("a", "b"):
        state["w"] += 1
        dcp.async_save(state, storage_writer=ShardstoreWriter(f"{root}/own-{name}", process_group=background),
                       planner=DefaultSavePlanner(enable_plan_caching=True), process_group=background,
                       ).result(timeout=60)


def test_async_saves_with_plan_caching_plan_on_the_writers_group(tmp_path: Path) -> None:
    run_distributed(cached_async_saves, 2, str(tmp_path), timeout=180)
    for name, value in (("default-b", 3.0), ("own-b", 5.0)):
        loaded = {"w": torch.zeros(64, 8), "r0": torch.zeros(64, 8), "r1": torch.zeros(64, 8)}
        dcp_load(loaded, tmp_path / name)
        assert loaded["w"].eq(value).all() and loaded["r1"].eq(1.0).all(), (name, loaded)
        assert shardstore.verify(tmp_path / name).ok


def dcp_load(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=ShardstoreReader(path), no_dist=True)


def replicated_tensor_changes_shape(rank: int, world: int, root: str) -> None:
    """Every rank holds ``w``; rank 1 also a larger tensor of its own, so DCP's
    deduplication gives ``w`` to rank 0. ``w`` then changes shape on every rank: both
    plans change, but rank 1's deduplicated plan does not, so DCP's cache hands it its
    previous plan. What rank 1 holds now is its items' word, not the earlier save's."""
    import torch.distributed.checkpoint as dcp

    for step, rows in enumerate((64, 32)):
        state = {"w": torch.full((rows, 8), float(step))}
        if rank == 1:
            state["big1"] = torch.full((1024, 8), float(step))
        dcp.save(state, storage_writer=RecordingWriter(f"{root}/step{step}"),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
    return RecordingWriter.usable


def test_a_rank_handed_its_cached_plan_holds_what_its_items_say(tmp_path: Path) -> None:
    usable = run_distributed(replicated_tensor_changes_shape, 2, str(tmp_path))
    assert usable[0] == [[True, True], [True, False]], usable[0]
    loaded = {"w": torch.zeros(32, 8), "big1": torch.zeros(1024, 8)}
    dcp_load(loaded, tmp_path / "step1")
    assert loaded["w"].eq(1.0).all() and loaded["big1"].eq(1.0).all()


def failed_then_retried(rank: int, world: int, root: str) -> list[str]:
    """Save A; save B, where every rank's plan changed, fails while the coordinator
    begins it (a storage error: DCP has cached B's plans by then); save C, the same
    state again, is B's retry. Returns what each save did."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.full((64, 8), 1.0), f"r{rank}": torch.full((64, 8), float(rank))}
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/A"), planner=DefaultSavePlanner(enable_plan_caching=True))
    state[f"new{rank}"] = torch.arange(1024, dtype=torch.float32) + rank
    real = ShardstoreWriter._open_save

    def failing(self: ShardstoreWriter, *args: Any) -> Any:
        raise OSError("simulated storage error beginning the save")

    ShardstoreWriter._open_save = failing
    with pytest.raises(DcpFailure, match="simulated storage error"):
        dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/B"), planner=DefaultSavePlanner(enable_plan_caching=True))
    ShardstoreWriter._open_save = real
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/C"), planner=DefaultSavePlanner(enable_plan_caching=True))
    return sorted(state)


def test_a_save_that_failed_after_dcp_cached_its_plans_is_retried_whole(tmp_path: Path) -> None:
    """DCP caches a save's plans before the writer plans; a failure there used to leave
    DCP's cache half made (no rank's ``finish_plan`` ran), and the retry was planned from
    the save before: committed without the new tensors, loading as damaged. Now the
    refusal reaches every rank as its part, DCP's cache stays whole, and the retry holds
    every tensor."""
    names = run_distributed(failed_then_retried, 2, str(tmp_path))
    assert not (tmp_path / "B" / "zarr.json").exists()
    loaded = {"w": torch.zeros(64, 8), "r0": torch.zeros(64, 8), "r1": torch.zeros(64, 8),
              "new0": torch.zeros(1024), "new1": torch.zeros(1024)}
    assert sorted({*names[0], *names[1]}) == sorted(loaded)
    dcp_load(loaded, tmp_path / "C")
    assert torch.equal(loaded["new1"], torch.arange(1024, dtype=torch.float32) + 1) and loaded["r1"].eq(1).all()
    assert shardstore.verify(tmp_path / "C").ok


def refused_then_corrected(rank: int, world: int, root: str, rank1_changes: bool) -> str:
    """The first save is refused (ranks hold ``w`` in two dtypes); the corrected state
    (and, with ``rank1_changes``, a tensor of rank 1's own) then saves twice."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.ones(64, 8, dtype=torch.float32 if rank == 0 else torch.float16), f"r{rank}": torch.ones(64, 8)}
    with pytest.raises(DcpFailure) as refused:
        dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/refused"),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
    state["w"] = torch.ones(64, 8)
    if rank1_changes and rank == 1:
        state["own1"] = torch.ones(512)
    for name in ("second", "third"):
        dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/{name}"),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
    return str(refused.value)


@pytest.mark.parametrize("rank1_changes", [False, True], ids=["same-plans", "rank-1-changes"])
def test_after_a_refused_first_save_the_corrected_state_saves(tmp_path: Path, rank1_changes: bool) -> None:
    errors = run_distributed(refused_then_corrected, 2, str(tmp_path), rank1_changes)
    assert all("different shapes or dtypes" in error for error in errors), errors
    for name in ("second", "third"):
        assert shardstore.verify(tmp_path / name).ok
    third = shardstore.load_plain_tensors(tmp_path / "third")  # own1 is packed: no directory of its own
    assert ("own1" in third) == rank1_changes, sorted(third)
    assert not rank1_changes or torch.equal(third["own1"], torch.ones(512))


def dcps_writer_then_ours(rank: int, world: int, root: str) -> None:
    """One planner class serves DCP's ``FileSystemWriter``, then ``ShardstoreWriter``,
    while rank 1's plan changes: rank 0 is handed ``FileSystemWriter``'s cached plan."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    state = {"w": torch.ones(64, 8), f"r{rank}": torch.full((64, 8), float(rank))}
    dcp.save(state, storage_writer=FileSystemWriter(f"{root}/dcp"), planner=DefaultSavePlanner(enable_plan_caching=True))
    if rank == 1:
        state["own1"] = torch.ones(512)
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/ours"), planner=DefaultSavePlanner(enable_plan_caching=True))


def test_a_plan_dcp_cached_for_another_writer_is_planned_again(tmp_path: Path) -> None:
    run_distributed(dcps_writer_then_ours, 2, str(tmp_path))
    loaded = {"w": torch.zeros(64, 8), "r0": torch.zeros(64, 8), "r1": torch.zeros(64, 8), "own1": torch.zeros(512)}
    dcp_load(loaded, tmp_path / "ours")
    assert loaded["r1"].eq(1).all() and loaded["own1"].eq(1).all() and shardstore.verify(tmp_path / "ours").ok


def settings_change_between_saves(rank: int, world: int, root: str) -> None:
    """Save A without ``shard_bytes``, B and C with it; in B rank 1 also holds ``z``, which
    DCP then gives rank 1, so rank 0's plan reaches the coordinator as DCP cached it from
    A: holdings made under A's settings (no place in an exchange group)."""
    import torch.distributed.checkpoint as dcp

    state = {"big0": torch.ones(1024, 8), "z": torch.full((64, 8), 2.0)} if rank == 0 else {"r1": torch.ones(64, 8)}
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/A"), planner=DefaultSavePlanner(enable_plan_caching=True))
    if rank == 1:
        state["z"] = torch.full((64, 8), 2.0)
    for name in ("B", "C"):
        dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/{name}", shard_bytes=1 << 20),
                 planner=DefaultSavePlanner(enable_plan_caching=True))


def test_holdings_made_under_other_writer_settings_are_taken_again(tmp_path: Path) -> None:
    run_distributed(settings_change_between_saves, 2, str(tmp_path))
    for name in ("B", "C"):
        loaded = {"big0": torch.zeros(1024, 8), "z": torch.zeros(64, 8), "r1": torch.zeros(64, 8)}
        dcp_load(loaded, tmp_path / name)
        assert loaded["z"].eq(2).all() and loaded["big0"].eq(1).all() and shardstore.verify(tmp_path / name).ok


def _unchanged_changed_and_back(rank: int, step: int) -> dict[str, Any]:
    """Saves 0-1: the same tensors; 2-4: rank 1 holds one more; 5: as saves 0-1 again."""
    state = {"w": torch.full((64, 8), float(step)), f"r{rank}": torch.full((64, 8), float(rank + step))}
    if rank == 1 and 2 <= step <= 4:
        state["own1"] = torch.arange(512, dtype=torch.float32) + step
    return state


def saves_that_reuse_plans(rank: int, world: int, root: str, shard_bytes: int | None) -> list[str]:
    import torch.distributed.checkpoint as dcp

    for step in range(6):
        dcp.save(_unchanged_changed_and_back(rank, step),
                 storage_writer=RecordingWriter(f"{root}/step{step}", shard_bytes=shard_bytes),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
    return RecordingWriter.plans


@pytest.mark.parametrize("shard_bytes", [None, 1 << 20], ids=["chunks", "shards"])
def test_a_save_whose_ranks_hold_a_recent_plans_inputs_reuses_it(tmp_path: Path, shard_bytes: int | None) -> None:
    """With DCP's plan caching, a save whose every rank has the items (and writer
    settings) of one recent plan's part reuses that plan, as a new save: the
    coordinator neither gathers the items nor plans. Save 1 reuses save 0's plan; save
    2 (rank 1 changed: DCP then hands rank 0 save 0's part, rank 1 a ``PlanAtWrite``)
    plans in ``write_data``; saves 3-4 reuse save 2's plan though DCP hands the ranks
    parts of two different saves; save 5, back to save 0's tensors, reuses save 0's."""
    plans = run_distributed(saves_that_reuse_plans, 2, str(tmp_path), shard_bytes)
    for rank_plans in plans:
        assert rank_plans == ["planned", "reused", "planned", "reused", "reused", "reused"], plans
    ids = set()
    for step in range(6):
        expected = {**_unchanged_changed_and_back(0, step), **_unchanged_changed_and_back(1, step)}
        loaded = {key: torch.zeros_like(value) for key, value in expected.items()}
        dcp_load(loaded, tmp_path / f"step{step}")
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), (step, key)
        assert shardstore.verify(tmp_path / f"step{step}").ok
        ids.add(json.loads((tmp_path / f"step{step}" / "zarr.json").read_text())["attributes"]["shardstore"]["save_id"])
    assert len(ids) == 6


def replica_dropped_by_the_rank_the_writer_chose(rank: int, world: int, root: str) -> list[str]:
    """Both ranks hold two replicated plain arrays, the smaller first: DCP's deduplication
    gives ``a_small`` to rank 0, the writer's balance (largest first) gives ``b_big`` to
    rank 0 and ``a_small`` to rank 1. From the second save rank 1 no longer holds
    ``a_small``; DCP's plans (after deduplication) do not change."""
    import torch.distributed.checkpoint as dcp

    for step in range(3):
        state = {"a_small": torch.arange(512, dtype=torch.float32) + step,
                 "b_big": torch.arange(2048, dtype=torch.float32) + step}
        if rank == 1 and step > 0:
            del state["a_small"]
        dcp.save(state, storage_writer=RecordingWriter(f"{root}/s{step}"),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
    return RecordingWriter.plans


def test_a_plan_is_not_reused_where_a_rank_dropped_a_replica_the_writer_gave_it(tmp_path: Path) -> None:
    """A recent plan is matched by the ranks' items after DCP's deduplication; the writer
    chose who writes a plain array among the ranks that held it before. Reusing the
    first plan had rank 1 write ``a_small``, which it no longer held: the save failed
    ("Could not find FQN"), and so did every later one. Now a rank votes for a plan only
    where it still holds what the plan has it write; the second save plans again, the
    third reuses that plan."""
    plans = run_distributed(replica_dropped_by_the_rank_the_writer_chose, 2, str(tmp_path))
    for rank_plans in plans:
        assert rank_plans == ["planned", "planned", "reused"], plans
    for step in range(3):
        loaded = {"a_small": torch.zeros(512), "b_big": torch.zeros(2048)}
        dcp_load(loaded, tmp_path / f"s{step}")
        assert torch.equal(loaded["a_small"], torch.arange(512, dtype=torch.float32) + step), step
        assert torch.equal(loaded["b_big"], torch.arange(2048, dtype=torch.float32) + step), step
        assert shardstore.verify(tmp_path / f"s{step}").ok


def saves_without_dcps_cache(rank: int, world: int, root: str) -> list[int]:
    """Three saves with DCP's default planner (no plan caching): the same structure
    twice, then a changed one; how many times the coordinator planned, after each."""
    import torch.distributed.checkpoint as dcp

    from shardstore.execution.pipeline import SavePipeline

    planned = [0]
    plan_gathered = SavePipeline.plan_gathered

    def counting(self: SavePipeline, *args: Any, **kwargs: Any) -> Any:
        planned[0] += 1
        return plan_gathered(self, *args, **kwargs)

    SavePipeline.plan_gathered = counting  # type: ignore[method-assign]
    counts = []
    try:
        model, optimizer = fm.build(world)
        for step, extra in enumerate((False, False, True)):
            fm.train_step(model, optimizer, step)
            state = _state(model, optimizer, step, rank, extra)
            dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/step{step}"))
            counts.append(planned[0])
            request = _state(*fm.build(world, seed=9), step, rank, extra)
            dcp.load(request, storage_reader=ShardstoreReader(f"{root}/step{step}"))
            fm.assert_same(fm.full_values(request), fm.full_values(state))
    finally:
        SavePipeline.plan_gathered = plan_gathered  # type: ignore[method-assign]
    return counts


def test_the_coordinator_plans_a_structure_it_saved_recently_once(tmp_path: Path) -> None:
    """A training loop saves the same structure at every step: the second save takes
    the first one's plan (a checkpoint of its own, bit-exact); a changed structure is
    planned anew."""
    coordinator, other = run_distributed(saves_without_dcps_cache, 2, str(tmp_path))
    assert coordinator == [1, 1, 2] and other == [0, 0, 0], (coordinator, other)
    records = [json.loads((tmp_path / f"step{s}" / "zarr.json").read_text()) for s in range(3)]
    ids = {r["attributes"]["shardstore"]["save_id"] for r in records}
    assert len(ids) == 3, ids
