"""Every collective of a save and a load runs through the one stage helper, and a
failure on one rank just before any of them fails every rank alike, within seconds
(issue 33.3).

The collective call sites are not listed by hand: a normal 2-rank save and load (with
a straddling chunk, a replicated block, a factory, an object, common state that differs
between the ranks, and Megatron-Core's direct ``determine_global_metadata`` and
``validate_sharding_integrity(common_state_dict=...)``) runs with every
``torch.distributed`` collective wrapped, and each call records the ``run_stage`` call
that made it (or, if none did, its own caller: the first test fails on it). Then, for
each stage call found (its caller's file, function and line, and which call of that site
it was) and each part of a stage that runs just before one of its collectives (the work
on either rank, before the gather or agreement; the coordinator's reduction, before
the scatter or broadcast; the planning of the transfers, before the exchange), one
rank fails there and every rank must raise the same ``CheckpointingException``, naming
the injected failure, within ``PROMPT_S`` seconds; the process group's timeout (60 s
in ``tests/dist.py``) would be a hang.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardstore import CheckpointingException, ShardedTensor, load, save
from shardstore.protocol.collectives import Group, StageFailed
from shardstore.protocol.stage import Deliver, run_stage
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from shardstore.validation import determine_global_metadata, validate_sharding_integrity
from tests.dist import run_distributed
from tests.test_collective_counts import COLS, COUNTED_COLLECTIVES, state_dict

PROMPT_S = 10.0
ORIGINAL_RUN_STAGE = run_stage
_ROOT = Path(__file__).resolve().parents[1]


class Injected(Exception):
    """The failure a test injects."""


def scenario(rank: int, world: int, ckpt: str) -> None:
    """A save and a load that reach every stage: the plan (save and load), the
    common-state check (the ranks' common states differ), staging with the straddle
    exchange, the commit, the read with the replica exchange, Megatron-Core's direct
    collective APIs, and a save of gathered shards exchanged in waves."""
    sharded = state_dict(rank, world, empty=False)
    sharded["differs"] = {"rank": rank}  # only rank 0's is saved: the others are compared with it
    save(sharded, ckpt, sharded_strategy=ZarrSaveShardedStrategy(max_chunk_bytes=2 * COLS * 4))
    request = state_dict(rank, world, empty=True)
    loaded = load(request, ckpt)
    assert loaded["differs"] == {"rank": 0}
    direct = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, world))}
    validate_sharding_integrity(determine_global_metadata(direct)[1], common_state_dict={"differs": rank})
    # gathered into shards under a host memory bound: the shards are exchanged in two waves
    gathered = {f"g{i}": ShardedTensor.from_rank_offsets(f"g{i}", torch.full((4, COLS), float(i + rank)),
                                                         (0, rank, world)) for i in range(3)}
    save(gathered, f"{ckpt}-gathered", sharded_strategy=ZarrSaveShardedStrategy(
        shard_bytes=4 * world * COLS * 4, sync_staging_bytes=2))


# ---------------------------------------------------------------- finding the sites


def _site(frame: Any) -> str:
    code = frame.f_code
    try:
        path = Path(code.co_filename).resolve().relative_to(_ROOT)
    except ValueError:
        path = Path(code.co_filename)
    return f"{path}:{code.co_name}:{frame.f_lineno}"


def _run_stage_frame(frame: Any) -> Any:
    """The frame of the ``run_stage`` call on the stack above ``frame``, or None."""
    while frame is not None:
        if frame.f_code is ORIGINAL_RUN_STAGE.__code__:
            return frame
        frame = frame.f_back
    return None


def _shardstore_caller(frame: Any) -> str:
    while frame is not None:
        if "/shardstore/" in frame.f_code.co_filename:
            return _site(frame)
        frame = frame.f_back
    return "?"


@contextmanager
def patched_run_stage(replacement: Callable) -> Iterator[None]:
    """``run_stage`` replaced in every shardstore module that bound it (``from ...
    import run_stage`` copies the binding)."""
    patched = []
    for module in [m for k, m in list(sys.modules.items()) if k.startswith("shardstore") and m is not None]:
        if vars(module).get("run_stage") is ORIGINAL_RUN_STAGE:
            patched.append(module)
            module.run_stage = replacement
    try:
        yield
    finally:
        for module in patched:
            module.run_stage = ORIGINAL_RUN_STAGE


class StageSites:
    """The stage calls of one run, in order: (site, occurrence, has reduce, has
    transfers), with the collectives each made, and the collectives no stage made."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, bool, bool]] = []
        self.collectives: dict[tuple[str, int], list[str]] = {}
        self.outside: list[str] = []
        self._seen: dict[str, int] = {}
        self._current: list[tuple[str, int]] = []

    def run_stage(self, group: Group, what: str, work: Callable, **kwargs: Any) -> Any:
        site = _site(sys._getframe(1))
        occurrence = self._seen[site] = self._seen.get(site, -1) + 1
        call = (site, occurrence)
        self.calls.append((site, occurrence, kwargs.get("reduce") is not None, kwargs.get("transfers") is not None))
        self.collectives[call] = []
        self._current.append(call)
        try:
            return ORIGINAL_RUN_STAGE(group, what, work, **kwargs)
        finally:
            self._current.pop()

    def wrap(self, name: str, fn: Callable) -> Callable:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if _run_stage_frame(caller) is None or not self._current:
                self.outside.append(f"{name} from {_shardstore_caller(caller)}")
            else:
                self.collectives[self._current[-1]].append(name)
            return fn(*args, **kwargs)

        return recorded


def record_sites(rank: int, world: int, ckpt: str) -> StageSites:
    sites = StageSites()
    originals = {name: getattr(dist, name) for name in COUNTED_COLLECTIVES}
    for name, fn in originals.items():
        setattr(dist, name, sites.wrap(name, fn))
    try:
        with patched_run_stage(sites.run_stage):
            scenario(rank, world, ckpt)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return sites


def recorded_sites(rank: int, world: int, root: str) -> tuple[list, dict, list]:
    sites = record_sites(rank, world, f"{root}/recorded")
    return sites.calls, {f"{s}#{o}": c for (s, o), c in sites.collectives.items()}, sites.outside


def test_every_collective_of_a_save_and_a_load_runs_in_the_stage_helper(tmp_path: Path) -> None:
    results = run_distributed(recorded_sites, 2, str(tmp_path))
    (calls, collectives, outside), (calls_1, _, outside_1) = results
    assert outside == [] and outside_1 == [], f"collectives outside protocol.stage.run_stage: {outside + outside_1}"
    assert calls == calls_1  # both ranks make the same stages, in the same order
    sites = {site.split(":")[1] for site, _, _, _ in calls}
    # the plan (save and load), the common-state check, staging, commit, read and Megatron's APIs
    assert {"gather_and_plan", "check_common_state_consistency", "stage_save", "finalize_save",
            "run_read_plan", "validate_common_state_dict", "determine_global_metadata"} <= sites, sites
    exchanged = [site for site, made in collectives.items() if "batch_isend_irecv" in made]
    # the straddle exchange of the save, the replica exchange of the load, the two waves of the gathered save
    assert len(exchanged) == 4, collectives
    assert len({site for site, _, _, _ in calls if ":stage_save:" in site}) == 2, calls  # staging, and a wave
    assert all(made for made in collectives.values()), collectives  # every stage talked to the other rank


# ---------------------------------------------------------------- failing each one


def _failing(fn: Callable, where: str) -> Callable:
    """``fn`` that runs, then fails just before the collective that follows it."""

    def failed(*args: Any, **kwargs: Any) -> Any:
        fn(*args, **kwargs)
        raise Injected(f"injected failure in {where}")

    return failed


def _injecting(target: tuple[str, int], part: str, fired: list[str]) -> Callable:
    """A ``run_stage`` that fails ``part`` of the ``target`` stage call on this rank."""
    seen: dict[str, int] = {}

    def injecting(group: Group, what: str, work: Callable, **kwargs: Any) -> Any:
        site = _site(sys._getframe(1))
        seen[site] = seen.get(site, -1) + 1
        if (site, seen[site]) == target:
            where = f"the {part} of {site} #{seen[site]} on rank {group.rank}"
            fired.append(where)
            if part == "work":
                work = _failing(work, where)
            else:
                kwargs[part] = _failing(kwargs[part], where)
        return ORIGINAL_RUN_STAGE(group, what, work, **kwargs)

    return injecting


def fail_each_stage(rank: int, world: int, root: str, part: str, failing_rank: int) -> list[tuple]:
    """For each stage call of the scenario with ``part``: fails it on ``failing_rank``
    and returns, per call, what this rank raised and how long after the start."""
    calls = record_sites(rank, world, f"{root}/recorded").calls
    targets = [(site, occ) for site, occ, has_reduce, has_transfers in calls
               if part == "work" or (part == "reduce" and has_reduce) or (part == "transfers" and has_transfers)]
    outcomes = []
    for i, target in enumerate(targets):
        fired: list[str] = []
        injection = _injecting(target, part, fired) if rank == failing_rank else ORIGINAL_RUN_STAGE
        start = time.monotonic()
        try:
            with patched_run_stage(injection):
                scenario(rank, world, f"{root}/{part}{i}")
            outcome = ("no error", "")
        except CheckpointingException as exc:
            outcome = (type(exc).__name__, str(exc))
        except Exception as exc:  # noqa: BLE001  (reported: every rank must raise a CheckpointingException)
            outcome = (f"not a CheckpointingException: {type(exc).__name__}", str(exc))
        outcomes.append((f"{target[0]}#{target[1]}", fired, *outcome, time.monotonic() - start))
    return outcomes


def _check_every_rank_failed_alike(results: list[list[tuple]], failing_rank: int, expected: int) -> None:
    assert len(results[0]) >= expected, results[0]
    for per_rank in zip(*results, strict=True):
        site = per_rank[0][0]
        assert per_rank[failing_rank][1], f"{site}: the injection did not fire"
        messages = {message for _, _, _, message, _ in per_rank}
        kinds = {kind for _, _, kind, _, _ in per_rank}
        assert len(messages) == 1 and kinds <= {"CheckpointingException", "StageFailed"}, (site, per_rank)
        assert "injected failure" in messages.pop(), (site, per_rank)
        slowest = max(seconds for *_, seconds in per_rank)
        assert slowest < PROMPT_S, f"{site}: a rank raised after {slowest:.1f} s (a wait, not an agreement)"


@pytest.mark.timeout(720)  # over run_distributed's 600 s, so its stacks come first
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_failure_in_any_stage_work_fails_every_rank_alike_within_seconds(tmp_path: Path, failing_rank: int) -> None:
    results = run_distributed(fail_each_stage, 2, str(tmp_path), "work", failing_rank, timeout=600)
    _check_every_rank_failed_alike(results, failing_rank, expected=11)


@pytest.mark.timeout(720)  # over run_distributed's 600 s, so its stacks come first
def test_a_failure_in_any_reduction_fails_every_rank_alike_within_seconds(tmp_path: Path) -> None:
    results = run_distributed(fail_each_stage, 2, str(tmp_path), "reduce", 0, timeout=600)
    _check_every_rank_failed_alike(results, 0, expected=8)


@pytest.mark.timeout(420)  # over run_distributed's 300 s, so its stacks come first
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_failure_planning_the_transfers_fails_every_rank_alike_within_seconds(
    tmp_path: Path, failing_rank: int
) -> None:
    """Before: the transfers were planned after the agreement, so the other rank waited
    in the exchange for a peer that had given up (until the process group timed out)."""
    results = run_distributed(fail_each_stage, 2, str(tmp_path), "transfers", failing_rank, timeout=300)
    _check_every_rank_failed_alike(results, failing_rank, expected=2)


# ---------------------------------------------------------------- what cannot travel


def _unpicklable() -> Callable:
    return lambda: None  # a local function: pickle refuses it


def stages_with_unpicklable_messages(rank: int, world: int) -> list[str]:
    group = Group()
    messages = []
    cases = [
        ("a result", dict(work=lambda: _unpicklable() if rank == 1 else 1, reduce=lambda g: g)),
        ("a reduction", dict(work=lambda: rank, reduce=lambda g: _unpicklable())),
        ("a scattered part", dict(work=lambda: rank, reduce=lambda g: [1, _unpicklable()], deliver=Deliver.SCATTER)),
        ("too few parts", dict(work=lambda: rank, reduce=lambda g: [1], deliver=Deliver.SCATTER)),
    ]
    for what, kwargs in cases:
        with pytest.raises(StageFailed) as info:
            run_stage(group, f"Sending {what}", **kwargs)
        messages.append(str(info.value))
    return messages


def test_what_cannot_be_sent_fails_every_rank_alike() -> None:
    """``torch.distributed`` pickles inside the collective: a rank whose message fails
    to pickle never joined it, and its peers waited until the timeout."""
    rank_0, rank_1 = run_distributed(stages_with_unpicklable_messages, 2, timeout=120)
    assert rank_0 == rank_1
    assert "rank(s) 1" in rank_0[0] and "pickle" in rank_0[0].lower(), rank_0[0]
    assert all("coordinator" in m for m in rank_0[1:3]), rank_0
    assert "1 parts for 2 ranks" in rank_0[3], rank_0[3]


class Unrepresentable:
    """Neither pickled nor repr'ed: both raise."""

    def __reduce__(self) -> Any:
        raise TypeError("Unrepresentable cannot be pickled")

    def __repr__(self) -> str:
        raise RuntimeError("Unrepresentable has no repr")


def save_unrepresentable_common_state(rank: int, world: int, ckpt: str) -> tuple[str, float]:
    """The issue's case: rank 0's common state holds a value whose repr raises (it
    cannot be pickled either), and rank 1's differs, so rank 0 sends its state for the
    comparison. Before: rank 0 raised alone before the scatter; rank 1 waited."""
    logging.getLogger("shardstore").setLevel(logging.ERROR)
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), (0, rank, world)),
          "odd": Unrepresentable() if rank == 0 else 1}
    start = time.monotonic()
    with pytest.raises(CheckpointingException) as info:
        save(sd, ckpt)
    return str(info.value), time.monotonic() - start


def test_a_common_state_that_cannot_be_represented_fails_every_rank_alike(tmp_path: Path) -> None:
    (message_0, seconds_0), (message_1, seconds_1) = run_distributed(
        save_unrepresentable_common_state, 2, str(tmp_path / "ckpt"), timeout=120
    )
    assert message_0 == message_1 and "Unrepresentable cannot be pickled" in message_0, (message_0, message_1)
    assert max(seconds_0, seconds_1) < PROMPT_S
    assert not (tmp_path / "ckpt" / "zarr.json").exists()



# ---------------------------------------------------------------- between the stages


def save_that_rank_1_cannot_join(rank: int, world: int, ckpt: str) -> tuple[str, str, float]:
    """Rank 1 cannot open the save's staging directory when it joins the save (after
    the plan stage, before the staging stage): a per-node failure such as too many open
    files. A rank that raised alone lives on, as a trainer that logs a failed save
    does, so its peer would wait for it in the staging stage."""
    from shardstore.stores.local import LocalStore

    if rank == 1:
        def refuse(self: LocalStore) -> None:
            raise Injected("injected failure opening the staging directory")

        LocalStore.begin_writes = refuse
    start = time.monotonic()
    try:
        save(state_dict(rank, world, empty=False), ckpt)
    except CheckpointingException as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    except Injected as exc:  # raised alone: live on past the peer's patience
        time.sleep(PROMPT_S + 2)
        return "not a CheckpointingException: Injected", str(exc), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def test_a_rank_that_cannot_join_the_save_fails_every_rank_alike_within_seconds(tmp_path: Path) -> None:
    """Before: the join (each rank's opening of the coordinator's staging directory,
    between the plan and the staging stage) raised its bare error on that rank alone,
    and the coordinator waited in the staging stage until the peer's process ended or
    the process group timed out, leaving the staging directory behind."""
    results = run_distributed(save_that_rank_1_cannot_join, 2, str(tmp_path / "ckpt"), timeout=120)
    (kind_0, message_0, seconds_0), (kind_1, message_1, seconds_1) = results
    assert {kind_0, kind_1} == {"StageFailed"} and message_0 == message_1, results
    assert "rank(s) 1" in message_0 and "injected failure" in message_0 and str(tmp_path / "ckpt") in message_0
    assert max(seconds_0, seconds_1) < PROMPT_S, results
    assert list(tmp_path.iterdir()) == [], "the failed save left its staging directory"
