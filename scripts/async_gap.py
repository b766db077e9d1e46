"""How an async save's background I/O disturbs a Python-heavy training loop.

One process runs a training-like loop (pure Python work, ~2 ms a step) while an async
save of ``--mib`` MiB writes in the background; ``--busy`` other processes keep every
core saturated, as busy data loaders do. For each I/O priority it reports the loop's
worst step gap and its step rate during the save, against the same loop with no save
(same run, interleaved rounds, medians over ``--reps``).

The failure this guards against: a background thread at SCHED_IDLE that is starved
of CPU while it holds the GIL stalls the training thread until the scheduler lets the
idle thread run again (seconds on saturated cores).

    .venv/bin/python scripts/async_gap.py --mib 256 --reps 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import torch

from shardstore import ShardedTensor, save
from shardstore.engine.async_requests import IO_PRIORITIES, AsyncCallsQueue


def _spin(stop: mp.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1


def _step() -> None:
    total = 0
    for i in range(20000):  # pure Python: needs the GIL throughout
        total += i * i


def _loop_until(done, min_seconds: float) -> list[float]:
    """Step durations (seconds) until ``done()`` and at least ``min_seconds``."""
    steps, start = [], time.perf_counter()
    last = start
    while not done() or time.perf_counter() - start < min_seconds:
        _step()
        now = time.perf_counter()
        steps.append(now - last)
        last = now
    return steps


def _one_round(priority: str | None, mib: int, root: str, round_: int) -> dict:
    if priority is None:
        steps = _loop_until(lambda: True, 3.0)
        return {"worst_ms": max(steps) * 1e3, "steps_per_s": len(steps) / sum(steps), "save_s": 0.0}
    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.randn(mib * 2**20 // 4 // 16))
             for i in range(16)}
    queue = AsyncCallsQueue(io_priority=priority)
    start = time.perf_counter()
    queue.schedule_async_request(save(state, f"{root}/{priority}-{round_}", async_sharded_save=True))
    future = queue._pending[0][2]
    steps = _loop_until(future.done, 0.0)
    save_s = time.perf_counter() - start
    queue.close()
    return {"worst_ms": max(steps) * 1e3, "steps_per_s": len(steps) / sum(steps), "save_s": save_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="spinning processes")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    results: dict[str, list[dict]] = {}
    cases: list[str | None] = [None, *IO_PRIORITIES]
    try:
        with tempfile.TemporaryDirectory() as root:
            for round_ in range(args.reps):
                for case in cases[round_ % len(cases):] + cases[: round_ % len(cases)]:  # rotate the order
                    results.setdefault(case or "no save", []).append(_one_round(case, args.mib, root, round_))
    finally:
        stop.set()
        for p in spinners:
            p.join()
    base = statistics.median(r["steps_per_s"] for r in results["no save"])
    print(f"{args.mib} MiB async save, {args.busy} spinning processes on {os.cpu_count()} cores, medians of {args.reps}")
    print(f"{'case':>10} {'worst gap ms':>13} {'loop rate vs no save':>21} {'save s':>8}")
    summary = {}
    for case, rounds in results.items():
        row = {k: statistics.median(r[k] for r in rounds) for k in ("worst_ms", "steps_per_s", "save_s")}
        row["rate_ratio"] = row["steps_per_s"] / base
        summary[case] = row
        print(f"{case:>10} {row['worst_ms']:13.1f} {row['rate_ratio']:21.2f} {row['save_s']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
