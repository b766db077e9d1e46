"""A save interrupted at a random moment (Ctrl-C, SIGTERM, kill -9), then at once
another save into the same place, as a job that restarts automatically makes it.

Every round, on S3 (2 ranks), on a local disk (2 ranks) and on ``memory://`` (one
process, interrupted by a KeyboardInterrupt): the next save commits without waiting on
the dead one, what it committed loads bit-exact and verifies, and nothing of the
checkpoint committed before is lost where the interrupted save was not an overwrite.
On S3 a Ctrl-C used to leave a prefix of chunk objects with no marker that every later
save refused for good (3 of 9 tries), and a kill left a claim that refused saves for a
minute.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from shardstore import ShardedTensor, load, save, verify
from shardstore.format.records import COMMIT_RECORD, is_committed, read_commit_record
from shardstore.format.records.claim_document import (
    ABANDONED,
    WRITING,
    ClaimDocument,
    ProcessIdentity,
)
from shardstore.stores.locations import open_location
from shardstore.testing import free_port
from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions
from shardstore.tools.root_verify import entries_under
from tests.dist import _context, _worker
from tests.s3_support import MotoServer, s3_options

pytestmark = pytest.mark.timeout(600)

BUCKET = "interrupted-saves"
ROUNDS = 20
ARRAYS, ELEMENTS = 6, (1 << 19)  # 6 arrays of 2 MiB, split by rows between the ranks
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
# A save that finds nothing to wait on commits within this (seconds); the lease is 60 s.
WITHOUT_WAITING_S = 30.0


@pytest.fixture(scope="module")
def server(moto_server: MotoServer) -> MotoServer:
    moto_server.create_bucket(BUCKET)
    return moto_server


def _state(who: int, rank: int = 0, world: int = 1, empty: bool = False) -> dict:
    sd: dict = {}
    for i in range(ARRAYS):
        full = torch.full((ELEMENTS,), float(who * 100 + i))
        part = full.chunk(world)[rank]
        sd[f"w{i}"] = ShardedTensor.from_rank_offsets(
            f"w{i}", torch.empty_like(part) if empty else part.clone(), (0, rank, world))
    sd["norm"] = ShardedTensor.from_rank_offsets("norm", torch.full((64,), float(who)), replica_id=rank)
    return sd


def _open(target: str, endpoint: str | None):
    return open_location(target) if endpoint is None else open_location(target, options=s3_options(endpoint))


def _assert_holds(target: str, endpoint: str | None, who: int) -> None:
    location = _open(target, endpoint)
    loaded = load(_state(who, empty=True), location)
    for i in range(ARRAYS):
        assert torch.equal(loaded[f"w{i}"], torch.full((ELEMENTS,), float(who * 100 + i))), (who, i)
    assert torch.equal(loaded["norm"], torch.full((64,), float(who)))
    report = verify(location)
    assert report.ok, str(report)


def _save_rank(rank: int, world: int, target: str, endpoint: str | None, who: int, overwrite: bool) -> None:
    save(_state(who, rank, world), _open(target, endpoint), overwrite=overwrite)


def _interrupt_a_save(target: str, endpoint: str | None, who: int, overwrite: bool, sig: int, after_s: float) -> None:
    """Starts a 2-rank save of ``who`` and sends ``sig`` to both ranks ``after_s``
    seconds later, as torchrun does on Ctrl-C; waits until both exited (SIGKILL after
    10 s, as torchrun does after its SIGTERM)."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, _save_rank, (target, endpoint, who, overwrite), results))
             for r in range(2)]
    for p in procs:
        p.start()
    time.sleep(after_s)
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            os.kill(p.pid, sig)
    for p in procs:
        p.join(timeout=10)
        if p.exitcode is None:
            p.kill()
            p.join(timeout=10)


def _left(target: str, endpoint: str | None, who: int) -> str:
    """What the interrupted save of ``who`` left at ``target``."""
    location = _open(target, endpoint)
    if not location.exists(COMMIT_RECORD):
        return "leftovers" if location.list_top(1) else "nothing"
    if not is_committed(location):
        return "a claim"
    return "its checkpoint" if read_commit_record(location).save_id and _committed_who(location) == who else "the old one"


def _committed_who(location) -> int:
    return int(load({"norm": ShardedTensor.from_rank_offsets("norm", torch.empty(64))}, location)["norm"][0])


def _rounds(target_of, endpoint: str | None, latest_s: float) -> None:
    """``ROUNDS`` interrupted saves, each ``signal`` sent up to ``latest_s`` seconds after
    the ranks start (about as long as the save takes), each followed by a save at once."""
    rng = random.Random(7)
    seen = []
    for round_ in range(ROUNDS):
        target = target_of(round_ // 2)  # two rounds per place: into a new one, then over what stands
        _interrupt_a_save(target, endpoint, 1000 + round_, round_ % 2 == 1, SIGNALS[round_ % len(SIGNALS)],
                          rng.uniform(0.1, latest_s))
        seen.append(_left(target, endpoint, 1000 + round_))
        started = time.monotonic()
        save(_state(round_), _open(target, endpoint), overwrite=True)
        assert time.monotonic() - started < WITHOUT_WAITING_S, f"round {round_}: waited on a dead save"
        _assert_holds(target, endpoint, round_)
    assert "leftovers" not in seen, f"objects without a claim or record, which no later save may remove: {seen}"
    assert len(set(seen)) > 1, f"every save was interrupted at the same stage: {seen}"
    print("what the interrupted saves left:", {state: seen.count(state) for state in set(seen)})


def test_s3_saves_interrupted_at_random_moments_never_block_the_next_one(server: MotoServer) -> None:
    _rounds(lambda place: f"s3://{BUCKET}/round{place}/ck", server.endpoint, 4.0)


def test_local_saves_interrupted_at_random_moments_never_block_the_next_one(tmp_path: Path) -> None:
    _rounds(lambda place: str(tmp_path / f"round{place}"), None, 1.5)


def test_memory_saves_interrupted_at_random_moments_never_block_the_next_one() -> None:
    """One process (``memory://`` is private to it): a KeyboardInterrupt at a random
    moment of the save, as Ctrl-C raises it, then the next save at once."""
    rng = random.Random(11)

    def interrupt(signum, frame):  # noqa: ANN001
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        for round_ in range(ROUNDS):
            target = f"memory://interrupted-saves/round{round_ // 2}"
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0, 0.15))
            try:
                save(_state(1000 + round_), target, overwrite=round_ % 2 == 1)
            except KeyboardInterrupt:
                pass
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            save(_state(round_), target, overwrite=True)
            _assert_holds(target, None, round_)
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_the_managers_retention_removes_what_an_interrupted_step_left(server: MotoServer) -> None:
    """A step whose save was interrupted (its given-up claim and its objects) and that
    the job, resumed from the step before, trained past: the next save's retention
    removes it, where it was left for good before (``verify`` said "no problems")."""
    root = open_location(f"s3://{BUCKET}/manager", options=s3_options(server.endpoint))
    manager = CheckpointManager(root, CheckpointManagerOptions(max_to_keep=2))
    try:
        manager.save(1, _state(1))
        step2 = root.child("iter_0000002")
        gone = ProcessIdentity("another-host", None, 1, None)
        step2.write_bytes(COMMIT_RECORD, ClaimDocument("2" * 32, ABANDONED, gone, 60.0).to_json())
        step2.write_bytes("w0/c.0", b"what the interrupted save wrote")
        step3 = root.child("iter_0000003")  # a save in flight elsewhere: never touched
        running = ClaimDocument("3" * 32, WRITING, gone, 60.0).to_json()
        step3.write_bytes(COMMIT_RECORD, running)
        assert set(entries_under(root)[1]) == {"iter_0000002", "iter_0000003"}
        manager.save(4, _state(4))
        assert step2.list_files() == [], "the interrupted step's objects and claim are gone"
        assert step3.read_bytes(COMMIT_RECORD) == running
        _assert_holds(root.child("iter_0000004").describe(), server.endpoint, 4)
    finally:
        manager.close()
