"""Run a test function on N real processes: gloo over 127.0.0.1 on a free port.

Workers come from a forkserver that has already imported torch and shardstore, so a
test pays for process start-up once, not for a torch import per rank. A worker's
exception (with its traceback) fails the test; what it returns travels by value (plain
pickle), never as a handle into its memory, so the parent can read it after the worker
has exited. A hang is killed after ``timeout``, once every rank and every process a rank
started (a forked background writer) has printed its Python stacks into the test's
failure message.
"""

from __future__ import annotations

__all__ = ["run_distributed"]

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardstore.testing import free_port

# Imported once by the forkserver, before it forks the ranks (a module not installed is skipped):
# a rank then pays no import of its own (megatron-core: 3 s per rank on 2 cores).
_PRELOAD = [
    "torch",
    "numpy",
    "tensorstore",
    "zarr",
    "shardstore.serialization",
    "shardstore.strategies.zarr",
    "shardstore.strategies.common",
    "tests.dist",
    "megatron.core.dist_checkpointing",  # where installed (3 s of imports, once, not per rank)
    "shardstore.megatron",
]


# Where CUDA is, the forkserver imports only what it imported when the GPU tests last
# passed (2026-11-26): with zarr and megatron-core preloaded too, every forked rank on the
# H200 machine failed with "Cannot re-initialize CUDA in forked subprocess" (one of those
# imports touches CUDA in the forkserver; a rank then pays its own imports).
_PRELOAD_WITH_CUDA = [name for name in _PRELOAD if not name.startswith(("zarr", "megatron", "shardstore.megatron"))]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD_WITH_CUDA if torch.cuda.is_available() else _PRELOAD)
    return ctx


# Where a rank's stacks go when the test harness asks (SIGUSR1): kept open for the
# rank's life, and inherited by the processes it forks.
_STACKS_FILE: Any = None


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any, backend: str = "gloo",
    pg_timeout: float = 60, stacks_path: str | None = None,
) -> None:
    global _STACKS_FILE
    if stacks_path is not None:
        _STACKS_FILE = open(stacks_path, "w")  # noqa: SIM115 - open until the process exits
        faulthandler.register(signal.SIGUSR1, file=_STACKS_FILE, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        if backend == "nccl":  # one GPU per rank (NCCL refuses two ranks on one GPU)
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world_size, *args)
        # By value: the queue's pickler sends a tensor as a file descriptor that the
        # parent fetches from this process's socket, which ends with this process (the
        # parent, slow on a loaded machine, then fails in multiprocessing's Client).
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # reported to the test in the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 120, killed: tuple[int, ...] = (),
    backend: str = "gloo", pg_timeout: float = 60,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns the
    per-rank return values (must be picklable). ``fn`` must be a module-level function.

    ``timeout``: for all ranks together; keep it under pytest-timeout's limit (300 s,
    or the test's ``timeout`` mark), which otherwise fires first, without the stacks.
    ``killed``: ranks expected to die by SIGKILL (their value is None); the test fails
    if they exit any other way. ``backend``: ``"gloo"``, or ``"nccl"`` (each rank on its
    own GPU). ``pg_timeout``: the process group's timeout, in seconds.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="shardstore-stacks-") as stacks:
        procs = [
            ctx.Process(target=_worker, args=(
                r, world_size, port, fn, args, results, backend, pg_timeout, os.path.join(stacks, f"rank{r}"),
            ))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        finished = False
        try:
            outcomes = _collect(results, procs, killed, timeout, stacks)
            finished = True
        finally:
            _reap(procs, grace=10.0 if finished else 1.0)
    for r in killed:
        if procs[r].exitcode != -signal.SIGKILL:
            outcomes[r] = (False, f"expected to be killed, exit code {procs[r].exitcode}")
    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failures:
        raise AssertionError(_failed(failures))
    return [outcomes[r][1] for r in range(world_size)]


# How long a rank may be seen dead without its report before the test fails (seconds):
# a rank's report is in the queue's pipe before its process ends.
_DEAD_WITHOUT_REPORT_S = 2.0


def _collect(
    results: Any, procs: list[Any], killed: tuple[int, ...], timeout: float, stacks: str,
) -> dict[int, tuple[bool, Any]]:
    """Every rank's report but the ``killed`` ones', by rank; raises, with every live
    process's stacks, when ``timeout`` passes first or a rank ends without one."""
    outcomes: dict[int, tuple[bool, Any]] = {r: (True, None) for r in killed}
    waiting = set(range(len(procs))) - set(killed)
    deadline = time.monotonic() + timeout
    dead_since: dict[int, float] = {}
    while waiting:
        try:
            rank, ok, value = results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            now = time.monotonic()
            gone = [r for r in sorted(waiting) if procs[r].exitcode is not None
                    and now - dead_since.setdefault(r, now) >= _DEAD_WITHOUT_REPORT_S]
            if gone or now >= deadline:
                reported = sorted(set(outcomes) - set(killed))
                what = (f"rank(s) {gone} ended without a report (exit codes {[procs[r].exitcode for r in gone]})"
                        if gone else f"distributed test timed out after {timeout}s")
                failed = {r: v for r, (ok, v) in outcomes.items() if not ok}
                raise AssertionError(
                    f"{what}; ranks that reported: {reported}" + (f"\n{_failed(failed)}" if failed else "")
                    + _stacks_of(procs, stacks)
                ) from None
            continue
        outcomes[rank] = (ok, pickle.loads(value) if ok else value)
        waiting.discard(rank)
    return outcomes


def _failed(failures: dict[int, Any]) -> str:
    return "\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in sorted(failures.items()))


def _reap(procs: list[Any], grace: float) -> None:
    """Waits ``grace`` seconds for each rank to exit; kills those that do not, and
    every process under them first (a hung writer a rank forked outlives it otherwise)."""
    for p in procs:
        p.join(timeout=grace)
        if p.is_alive():
            for pid in [*_descendants(p.pid), p.pid]:
                _signal(pid, signal.SIGKILL)
            p.join()


def _descendants(pid: int) -> list[int]:
    """``pid``'s child processes and theirs, deepest last: the children of every thread
    (Linux ``/proc``; DCP starts its save process from a thread)."""
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone already
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return [found for child in children for found in (child, *_descendants(child))]


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` handles ``signum`` (``SigCgt`` in ``/proc/<pid>/status``):
    a process that does not (one started by ``spawn``, a non-Python helper) would be
    killed by it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught >> (signum - 1) & 1)


def _stacks_of(procs: list[Any], stacks: str) -> str:
    """Asks every live rank and every process under it that registered ``faulthandler``
    for SIGUSR1 (forked from a rank) for its Python stacks; returns them by rank, and
    names the processes it could not ask, for the failure message."""
    unasked = []
    for p in procs:
        if p.is_alive():
            for pid in [p.pid, *_descendants(p.pid)]:
                if _catches(pid, signal.SIGUSR1):
                    _signal(pid, signal.SIGUSR1)
                else:
                    unasked.append(f"{pid} ({_command_line(pid)})")
    time.sleep(2)
    out = []
    for r, p in enumerate(procs):
        path = os.path.join(stacks, f"rank{r}")
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
            if text:
                out.append(f"\n--- stacks of rank {r} (pid {p.pid}) and the processes it forked:\n{text}")
    if unasked:
        out.append(f"\n--- processes without stacks (no SIGUSR1 handler): {', '.join(unasked)}")
    return "".join(out)


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "gone"


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # ended meanwhile
        pass
