"""Writers that lose their claim while paused (SIGSTOP: a frozen VM, a long pause of the
process) change nothing of the save that took over, and say so.

Each test pauses a real process at one point of its work, lets another save take the
place over and commit, then resumes the paused one: the checkpoint that stands loads
bit-exact, and the paused process fails with a message that says what happened.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from shardstore import CheckpointingException, ShardedTensor, load, remove_sharded_tensors, save
from shardstore.format.records import COMMIT_RECORD, is_committed
from shardstore.stores.locations import open_location
from tests.dist import _context
from tests.s3_support import MotoServer, s3_options

pytestmark = pytest.mark.timeout(240)

BUCKET = "paused-writers"
ARRAYS, ELEMENTS = 8, (1 << 18) + 1024  # 8 arrays above 1 MiB: objects of their own on S3
LEASE_S = 2.0


@pytest.fixture(scope="module")
def server(moto_server: MotoServer) -> MotoServer:
    moto_server.create_bucket(BUCKET)
    return moto_server


def _state(who: int) -> dict:
    sd: dict = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.full((ELEMENTS,), float(who * 100 + i)))
                for i in range(ARRAYS)}
    sd["small"] = ShardedTensor.from_rank_offsets("small", torch.full((16,), float(who)))
    return sd


def _open(target: str, endpoint: str | None):
    if endpoint is None:
        return open_location(target)
    return open_location(target, options=s3_options(endpoint, save_lease_s=LEASE_S))


def _assert_holds(target: str, endpoint: str | None, who: int) -> None:
    location = _open(target, endpoint)
    request = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.empty(ELEMENTS)) for i in range(ARRAYS)}
    request["small"] = ShardedTensor.from_rank_offsets("small", torch.empty(16))
    loaded = load(request, location)
    for i in range(ARRAYS):
        assert torch.equal(loaded[f"w{i}"], torch.full((ELEMENTS,), float(who * 100 + i))), i
    assert torch.equal(loaded["small"], torch.full((16,), float(who)))


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def _pause_at(point: str, events) -> None:
    """In the paused process: stops it (SIGSTOP) at ``point`` of its work, once, after
    telling the test (``events``)."""
    from shardstore.format import removal
    from shardstore.format.claims import PrefixClaim
    from shardstore.stores import s3_fenced

    def once(original, before_stop=None):
        done = []

        def paused(*args, **kwargs):
            if not done:
                done.append(True)
                events.send(point)
                if before_stop is None:
                    _stop_self()
                else:
                    before_stop()
            return original(*args, **kwargs)

        return paused

    if point == "writing chunks":
        import threading

        def stop_soon() -> None:  # while the requests of this call are in flight
            threading.Timer(0.02, _stop_self).start()

        s3_fenced.put_new_objects = once(s3_fenced.put_new_objects, stop_soon)
        import shardstore.stores.s3 as s3

        s3.put_new_objects = s3_fenced.put_new_objects
    elif point == "committing":
        PrefixClaim.commit = once(PrefixClaim.commit)
    elif point == "rewriting the record":
        removal._Binding.write_record = once(removal._Binding.write_record)
    elif point == "deleting":
        removal._Binding.check = once(removal._Binding.check)
    else:
        raise AssertionError(point)


def _paused_save(target: str, endpoint: str | None, point: str, overwrite: bool, events, results) -> None:
    _pause_at(point, events)
    try:
        save(_state(1), _open(target, endpoint), overwrite=overwrite)
    except CheckpointingException as exc:
        results.send(("refused", str(exc)))
        return
    except Exception as exc:  # noqa: BLE001 - the test reads what the paused save said
        results.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    results.send(("committed", ""))


def _paused_removal(target: str, endpoint: str | None, point: str, events, results) -> None:
    _pause_at(point, events)
    try:
        remove_sharded_tensors(_open(target, endpoint), "small")
    except CheckpointingException as exc:
        results.send(("refused", str(exc)))
        return
    results.send(("removed", ""))


def _run_paused(fn, args, then) -> tuple[str, str]:
    """Runs ``fn(*args, events, results)`` in a process, waits until it stopped itself,
    calls ``then()``, resumes it and returns what it reported."""
    ctx = _context()
    (events, tell), (results, report) = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)  # sent at once, unbuffered
    proc = ctx.Process(target=fn, args=(*args, tell, report))
    proc.start()
    try:
        assert events.poll(120), "the process never reached the point it pauses at"
        events.recv()
        _wait_stopped(proc.pid)
        then()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert results.poll(120), "the resumed process never reported"
    outcome = results.recv()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    return outcome


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        time.sleep(0.01)
    raise AssertionError("the process did not stop")


@pytest.mark.parametrize("point", ["writing chunks", "committing"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_an_s3_save_paused_past_its_lease_changes_nothing_of_the_save_that_took_over(
    server: MotoServer, point: str, overwrite: bool
) -> None:
    target = f"s3://{BUCKET}/save-{point.replace(' ', '-')}-{overwrite}/ck"
    if overwrite:
        save(_state(7), _open(target, server.endpoint))

    def take_over() -> None:
        time.sleep(LEASE_S)  # the paused save's claim lapses (its process lives: only the lease tells)
        save(_state(2), _open(target, server.endpoint), overwrite=overwrite)

    outcome, message = _run_paused(_paused_save, (target, server.endpoint, point, overwrite), take_over)
    assert outcome != "committed", "a save that lost its claim never commits"
    assert "another save took the prefix over" in message or "another writer wrote an object there" in message, (
        message)
    assert "Nothing of this save is committed" in message or "Nothing was committed" in message, message
    _assert_holds(target, server.endpoint, 2)


@pytest.mark.parametrize("point", ["rewriting the record", "deleting"])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_removal_paused_across_an_overwrite_changes_nothing_of_the_new_checkpoint(
    server: MotoServer, tmp_path: Path, point: str, where: str
) -> None:
    endpoint = server.endpoint if where == "s3" else None
    target = f"s3://{BUCKET}/removal-{point.replace(' ', '-')}/ck" if where == "s3" else str(tmp_path / "ck")
    save(_state(1), _open(target, endpoint))

    def overwrite() -> None:
        save(_state(2), _open(target, endpoint), overwrite=True)

    outcome, message = _run_paused(_paused_removal, (target, endpoint, point), overwrite)
    assert outcome == "refused", (outcome, message)
    assert "the checkpoint there was replaced" in message and "remove the entries again" in message, message
    _assert_holds(target, endpoint, 2)
    location = _open(target, endpoint)
    assert is_committed(location) and location.exists(COMMIT_RECORD)
