"""Two independent programs save into one new place at the same moment.

At most one of them commits, what it committed loads whole (every array and the common
state from the same program), and the other one says truthfully what it found and
deletes nothing of the winner's: on S3 (moto on 127.0.0.1, which honours
``If-None-Match``/``If-Match`` on PUT) as on a local disk. With ``overwrite=True`` the
checkpoint that stands at the end is one save's, whole.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from shardstore import (
    CheckpointingException,
    ShardedTensor,
    load,
    load_common_state_dict,
    save,
    verify,
)
from shardstore.format.claims import PrefixClaim, Taken
from shardstore.format.records import COMMIT_RECORD, is_committed
from shardstore.format.records.claim_document import (
    WRITING,
    ClaimDocument,
    ProcessIdentity,
    this_process,
)
from shardstore.stores.locations import open_location
from shardstore.stores.s3 import S3Options
from shardstore.tools.root_verify import entries_under
from tests.dist import _context
from tests.s3_support import MotoServer, s3_options

BUCKET = "racing-saves"
ARRAYS, ELEMENTS = 16, (1 << 18) + 1024  # 16 arrays of 1 MiB and 4 KiB: above S3's pack bound
FIRST_CHUNK = "w0/c.0"  # a chunk object of a save (on S3, no array has a zarr.json of its own)
ROUNDS = 4


@pytest.fixture(scope="module")
def server(moto_server: MotoServer) -> MotoServer:
    moto_server.create_bucket(BUCKET)
    return moto_server


def _state(who: int) -> dict:
    sd: dict = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.full((ELEMENTS,), float(who * 100 + i)))
                for i in range(ARRAYS)}
    sd["who"] = who
    return sd


def _save_at_once(who: int, target: str, options: S3Options | None, overwrite: bool, barrier, results) -> None:
    location = open_location(target, options=options) if options is not None else open_location(target)
    barrier.wait()
    try:
        save(_state(who), location, overwrite=overwrite)
    except CheckpointingException as exc:
        results.put((who, "refused", str(exc)))
        return
    results.put((who, "committed", ""))


def _race(target: str, options: S3Options | None, overwrite: bool = False) -> dict[int, tuple[str, str]]:
    ctx = _context()
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_save_at_once, args=(who, target, options, overwrite, barrier, results))
             for who in (1, 2)]
    for p in procs:
        p.start()
    outcomes = {}
    for _ in procs:
        who, outcome, message = results.get(timeout=120)
        outcomes[who] = (outcome, message)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0, f"a saving process died ({p.exitcode})"
    return outcomes


def _check_whole(target: str, options: S3Options | None, committed: list[int]) -> None:
    """What stands at ``target`` is the checkpoint of one of ``committed``, whole."""
    location = open_location(target, options=options) if options is not None else open_location(target)
    report = verify(location)
    assert report.ok, str(report)
    who = load_common_state_dict(location)["who"]
    assert who in committed, (who, committed)
    request = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.empty(ELEMENTS)) for i in range(ARRAYS)}
    loaded = load(request, location)
    for i in range(ARRAYS):
        assert torch.equal(loaded[f"w{i}"], torch.full((ELEMENTS,), float(who * 100 + i))), (i, who)


def _check_round(outcomes: dict[int, tuple[str, str]], target: str, options: S3Options | None) -> None:
    committed = [who for who, (outcome, _) in outcomes.items() if outcome == "committed"]
    assert len(committed) == 1, f"exactly one of two racing saves commits: {outcomes}"
    loser = 3 - committed[0]
    message = outcomes[loser][1]
    assert "Removing" not in message and "deleted" not in message.lower(), message
    assert "another save" in message or "already holds a committed checkpoint" in message, message
    _check_whole(target, options, committed)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_two_saves_racing_into_one_new_s3_prefix(server: MotoServer, round_: int) -> None:
    target = f"s3://{BUCKET}/new{round_}/ck"
    _check_round(_race(target, s3_options(server.endpoint)), target, s3_options(server.endpoint))


@pytest.mark.parametrize("round_", range(2))
def test_two_saves_racing_into_one_new_local_directory(tmp_path: Path, round_: int) -> None:
    target = str(tmp_path / "ck")
    _check_round(_race(target, None), target, None)


def test_two_overwriting_saves_racing_on_s3_leave_one_checkpoint_whole(server: MotoServer) -> None:
    target = f"s3://{BUCKET}/overwrite/ck"
    options = s3_options(server.endpoint)
    save(_state(7), open_location(target, options=options))
    outcomes = _race(target, options, overwrite=True)
    committed = [who for who, (outcome, _) in outcomes.items() if outcome == "committed"]
    assert len(committed) >= 1 or all("another save" in m for _, m in outcomes.values()), outcomes
    _check_whole(target, options, committed or [7])


# ------------------------------------------------------------------ the claim itself


def _location(server: MotoServer, prefix: str, **options):
    return open_location(f"s3://{BUCKET}/{prefix}", options=s3_options(server.endpoint, **options))


def _take(location, save_id: str) -> tuple[PrefixClaim, Taken]:
    def committed(found):
        raise AssertionError("no commit record expected here")

    return PrefixClaim.take(location, save_id, when_empty=lambda: None, when_committed=committed)


def test_a_claim_is_renewed_while_its_save_runs_and_refuses_others(server: MotoServer) -> None:
    location = _location(server, "claims/renewed", save_lease_s=4.0)
    claim, taken = _take(location, "a" * 32)
    try:
        assert taken == Taken()
        time.sleep(9.0)  # past two leases: only renewals (every second) keep it alive
        started = time.monotonic()
        with pytest.raises(CheckpointingException, match="another save is writing there.*Nothing there was changed"):
            _take(location, "b" * 32)
        assert time.monotonic() - started < 4.0, "refused once it saw a renewal, within a lease"
        claim.check()
    finally:
        claim.stop()


def test_a_lapsed_claim_is_taken_over_and_its_save_does_not_commit(server: MotoServer) -> None:
    location = _location(server, "claims/dead", save_lease_s=1.0)
    first, _ = _take(location, "a" * 32)
    first.stop()  # the save hangs: no renewal from here on (its process lives: only the lease tells)
    time.sleep(2.0)
    second, taken = _take(location, "b" * 32)
    try:
        assert taken.over is not None and taken.over.claim.save_id == "a" * 32
        with pytest.raises(CheckpointingException, match="Nothing was committed.*nothing of the save that holds"):
            first.commit(b'{"zarr_format": 3}')
        assert not first.abandon()
        assert ClaimDocument.parse(location.read_bytes(COMMIT_RECORD)).save_id == "b" * 32
    finally:
        second.stop()


def test_a_save_whose_prefix_was_taken_over_commits_nothing_and_removes_nothing(
    server: MotoServer, monkeypatch
) -> None:
    """While the save writes, another save takes the prefix over (this one's claim ran
    out): the commit is refused, and its abandon leaves the other save's files alone."""
    target = f"s3://{BUCKET}/claims/taken-over"
    options = s3_options(server.endpoint)
    location = open_location(target, options=options)
    real_commit = PrefixClaim.commit
    theirs = ClaimDocument("c" * 32, WRITING, this_process(), 60.0).to_json()

    def taken_over_first(self: PrefixClaim, record: bytes) -> None:
        self.stop()
        assert self.writes.put_if_version(COMMIT_RECORD, theirs, self._version) is not None
        location.write_bytes("theirs.bin", b"the other save's")
        real_commit(self, record)

    monkeypatch.setattr(PrefixClaim, "commit", taken_over_first)
    with pytest.raises(CheckpointingException, match="another save took the prefix over"):
        save(_state(1), location)
    assert location.exists("theirs.bin") and location.exists(FIRST_CHUNK)
    assert location.read_bytes(COMMIT_RECORD) == theirs and not is_committed(location)


def test_a_claim_from_another_machine_is_waited_for_no_longer_than_its_lease(server: MotoServer) -> None:
    location = _location(server, "claims/elsewhere", save_lease_s=1.0)
    elsewhere = ClaimDocument("d" * 32, WRITING, ProcessIdentity("another-host", None, 1, 1), 3.0)
    assert location.store.conditional_writes().put_if_absent(COMMIT_RECORD, elsewhere.to_json()) is not None
    location.write_bytes("w0/c.0", b"what the other save wrote")
    started = time.monotonic()
    save(_state(8), location)  # its own 3 s lease, not this save's 1 s, is the one it renews within
    assert 1.5 < time.monotonic() - started < 30
    _check_whole(location.describe(), s3_options(server.endpoint), [8])


def test_a_claim_names_its_process_so_a_reused_pid_is_no_proof_of_life() -> None:
    here = this_process()
    assert not here.is_gone()
    reused = (here.start or 0) + 1
    assert ProcessIdentity(here.host, here.boot_id, here.pid, reused, here.pid_ns).is_gone()  # the pid reused
    assert not ProcessIdentity(here.host, here.boot_id, here.pid, reused, 1).is_gone()  # another pid namespace
    assert not ProcessIdentity("another-host", here.boot_id, 1, 1).is_gone()  # cannot be told from here
    assert not ProcessIdentity(here.host, "another boot", 1, 1).is_gone()


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("root", [b'{"shardstore_claim": 1, "state": "writing"}', b"garbage", None])
def test_what_no_claim_of_ours_proves_is_never_deleted(server: MotoServer, overwrite: bool, root) -> None:
    """Another program's objects, beside a root document or a legacy marker that
    shardstore cannot prove it wrote: every save is refused, whatever ``overwrite``."""
    location = _location(server, f"claims/foreign-{overwrite}-{len(root or b'')}")
    location.write_bytes("notes.txt", b"mine")
    location.write_bytes("results/eval.json", b"{}")
    if root is None:
        location.write_bytes(".shardstore-save.json", b'{"save_id": "' + b"e" * 32 + b'"}')
    else:
        location.write_bytes(COMMIT_RECORD, root)
    with pytest.raises(CheckpointingException, match="(?i)nothing there was changed|refusing to delete|refusing"):
        save(_state(9), location, overwrite=overwrite)
    assert location.read_bytes("notes.txt") == b"mine" and location.exists("results/eval.json")
    assert location.read_bytes(COMMIT_RECORD) == root if root is not None else not location.exists(COMMIT_RECORD)


def test_saves_on_a_store_without_conditional_writes_still_commit(server: MotoServer) -> None:
    location = _location(server, "claims/unconditional", conditional_writes=False)
    save(_state(3), location)
    with pytest.raises(CheckpointingException, match="already holds a committed checkpoint"):
        save(_state(4), location)
    save(_state(4), location, overwrite=True)
    assert load_common_state_dict(location)["who"] == 4 and verify(location).ok


def _save_then_die_before_commit(target: str, options: S3Options) -> None:
    """Writes every chunk of a save, then is SIGKILLed where it would commit."""
    import os
    import signal

    def die(self: PrefixClaim, record: bytes) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    PrefixClaim.commit = die
    save(_state(5), open_location(target, options=options))


def test_a_save_killed_on_s3_is_taken_over_at_once_on_its_machine(server: MotoServer) -> None:
    """The killed save's process is provably gone (same machine, its pid no longer that
    process): the next save takes its claim over without waiting out its 60 s lease and
    removes what it wrote."""
    target = f"s3://{BUCKET}/killed/ck"
    options = s3_options(server.endpoint)
    ctx = _context()
    victim = ctx.Process(target=_save_then_die_before_commit, args=(target, options))
    victim.start()
    victim.join(timeout=120)
    assert victim.exitcode == -9
    location = open_location(target, options=options)
    assert location.exists(FIRST_CHUNK) and not is_committed(location)
    with pytest.raises(CheckpointingException, match="a save is in flight there"):
        load({"w0": ShardedTensor.from_rank_offsets("w0", torch.empty(ELEMENTS))}, location)
    save(_state(4), open_location(f"s3://{BUCKET}/killed/other", options=options))
    found, leftovers = entries_under(open_location(f"s3://{BUCKET}/killed", options=options))
    assert set(found) == {"other"} and leftovers == ("ck",), "verify of the root names what the killed save left"
    started = time.monotonic()
    save(_state(6), location)
    assert time.monotonic() - started < 30
    _check_whole(target, options, [6])
