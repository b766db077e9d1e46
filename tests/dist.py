"""Run a test function on N real processes: gloo over 127.0.0.1 on a free port.

Workers come from a forkserver that has already imported torch and shardstore, so a
test pays for process start-up once, not for a torch import per rank. A worker's
exception (with its traceback) fails the test; a hang is killed after ``timeout``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
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


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any, backend: str = "gloo",
    pg_timeout: float = 60,
) -> None:
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
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, backend, pg_timeout))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {r: (True, None) for r in killed}
    try:
        for _ in range(world_size - len(killed)):
            rank, ok, value = results.get(timeout=timeout)
            outcomes[rank] = (ok, value)
    except Exception as exc:
        raise AssertionError(f"distributed test timed out after {timeout}s; finished ranks: {sorted(outcomes)}") from exc
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    for r in killed:
        if procs[r].exitcode != -signal.SIGKILL:
            outcomes[r] = (False, f"expected to be killed, exit code {procs[r].exitcode}")
    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failures:
        raise AssertionError("\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in sorted(failures.items())))
    return [outcomes[r][1] for r in range(world_size)]
