"""Run a test function on N real processes: gloo over 127.0.0.1 on a free port.

Workers come from a forkserver that has already imported torch and shardstore, so a
test pays for process start-up once, not for a torch import per rank. A worker's
exception (with its traceback) fails the test; a hang is killed after ``timeout``, once
every rank and every process a rank started (a forked background writer) has printed
its Python stacks into the test's failure message.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardstore.testing import free_port

_PRELOAD = [
    "torch",
    "numpy",
    "tensorstore",
    "shardstore.serialization",
    "shardstore.strategies.zarr",
    "shardstore.strategies.common",
    "tests.dist",
]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
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
        results.put((rank, True, value))
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
        outcomes: dict[int, tuple[bool, Any]] = {r: (True, None) for r in killed}
        deadline = time.monotonic() + timeout
        grace = 10.0  # for a rank to exit once it reported; 1 s once the test timed out
        try:
            for _ in range(world_size - len(killed)):
                rank, ok, value = results.get(timeout=max(0.0, deadline - time.monotonic()))
                outcomes[rank] = (ok, value)
        except Exception as exc:
            grace = 1.0
            raise AssertionError(
                f"distributed test timed out after {timeout}s; finished ranks: {sorted(outcomes)}"
                + "".join(f"\n--- rank {r} failed:\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok)
                + _stacks_of(procs, stacks)
            ) from exc
        finally:
            for p in procs:
                p.join(timeout=grace)
                if p.is_alive():  # and what it started: a hung writer it forked outlives it otherwise
                    for pid in [*_descendants(p.pid), p.pid]:
                        _signal(pid, signal.SIGKILL)
                    p.join()
    for r in killed:
        if procs[r].exitcode != -signal.SIGKILL:
            outcomes[r] = (False, f"expected to be killed, exit code {procs[r].exitcode}")
    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failures:
        raise AssertionError("\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in sorted(failures.items())))
    return [outcomes[r][1] for r in range(world_size)]


def _descendants(pid: int) -> list[int]:
    """``pid``'s child processes and theirs (Linux ``/proc``), deepest last."""
    found = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:  # gone already
        return []
    for child in children:
        found += [child, *_descendants(child)]
    return found


def _stacks_of(procs: list[Any], stacks: str) -> str:
    """Asks every live rank and every process under it (SIGUSR1: ``faulthandler``) for
    its Python stacks; returns them, by rank, for the failure message."""
    for p in procs:
        if p.is_alive():
            for pid in [p.pid, *_descendants(p.pid)]:
                _signal(pid, signal.SIGUSR1)
    time.sleep(2)
    out = []
    for r, p in enumerate(procs):
        path = os.path.join(stacks, f"rank{r}")
        text = open(path).read() if os.path.exists(path) else ""
        if text:
            out.append(f"\n--- stacks of rank {r} (pid {p.pid}) and the processes it started:\n{text}")
    return "".join(out)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # ended meanwhile
        pass
