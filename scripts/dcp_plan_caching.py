"""What DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``) changes in a
save's time, for ``ShardstoreWriter`` and DCP's own ``FileSystemWriter``, in one run
(docs/measurements/dcp.md, "Plan caching").

``--world`` ranks (gloo on 127.0.0.1) each hold ``--arrays`` FSDP2-style DTensors
(``Shard(0)`` over the ranks) of ``--rows`` x 64 float32, changed before every save.
Each repetition saves once with each of the four methods (writer x caching), in an
order that rotates per repetition, each into a new directory (all deleted at the end). The first repetition
fills DCP's plan cache and is left out. Printed per method: the median save time on
rank 0 (fastest-slowest) and the median CPU time of rank 0's process in the save (all
its threads: less disturbed than the wall time by other programs on the machine), and
the ratio of caching on to off for each writer.

    .venv/bin/python scripts/dcp_plan_caching.py --world 2 --arrays 1000 --reps 9
"""

from __future__ import annotations

__all__ = ["main"]

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardstore.testing import free_port

METHODS = [("shardstore", True), ("shardstore", False), ("dcp", True), ("dcp", False)]


def _writer(kind: str, path: str):
    from torch.distributed.checkpoint import FileSystemWriter

    from shardstore import ShardstoreWriter

    return ShardstoreWriter(path) if kind == "shardstore" else FileSystemWriter(path)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, root: str, out: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = {f"layers.{i}.weight": distribute_tensor(torch.randn(args.rows, 64), mesh, [Shard(0)])
             for i in range(args.arrays)}
    times: dict[tuple[str, bool], list[float]] = {method: [] for method in METHODS}
    cpu: dict[tuple[str, bool], list[float]] = {method: [] for method in METHODS}
    for rep in range(args.reps):
        for j in range(len(METHODS)):
            kind, caching = METHODS[(rep + j) % len(METHODS)]
            for tensor in state.values():
                tensor.to_local().add_(1)
            path = f"{root}/{kind}-{caching}-{rep}"
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            # DCP's cache is keyed by the planner's class: one class serves both writers
            # here, so each writer's saves get a planner class of their own
            planner = _PLANNERS[kind](enable_plan_caching=caching)
            dcp.save(state, storage_writer=_writer(kind, path), planner=planner)
            times[(kind, caching)].append(time.perf_counter() - start)
            cpu[(kind, caching)].append(time.process_time() - start_cpu)
            # outputs stay until the end: deleting inodes slows the next creations on
            # some file systems (docs/measurements/small-tensors.md), and unevenly
    out[rank] = times, cpu
    dist.destroy_process_group()


def _planner_classes() -> dict[str, type]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    return {kind: type(f"{kind.capitalize()}Planner", (DefaultSavePlanner,), {}) for kind in ("shardstore", "dcp")}


_PLANNERS = _planner_classes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--arrays", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="dcp-plan-caching-")
    try:
        out = mp.Manager().dict()
        mp.spawn(_rank, args=(args.world, free_port(), args, root, out), nprocs=args.world, join=True)
        times = {method: runs[1:] for method, runs in out[0][0].items()}
        cpu = {method: runs[1:] for method, runs in out[0][1].items()}
        mib = args.arrays * args.rows * 64 * 4 / (1 << 20)
        print(f"{args.world} ranks, {args.arrays} DTensors, {mib:.0f} MiB; {args.reps - 1} saves each after the first")
        for (kind, caching), runs in times.items():
            print(f"{kind:10s} caching {'on ' if caching else 'off'}: median {statistics.median(runs):.3f} s "
                  f"({min(runs):.3f}-{max(runs):.3f}); rank 0 CPU {statistics.median(cpu[(kind, caching)]):.3f} s")
        for kind in ("shardstore", "dcp"):
            ratio = statistics.median(times[(kind, True)]) / statistics.median(times[(kind, False)])
            cpu_ratio = statistics.median(cpu[(kind, True)]) / statistics.median(cpu[(kind, False)])
            print(f"{kind}: caching on takes {ratio:.2f}x the time of caching off, {cpu_ratio:.2f}x its CPU")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        os.sync()


if __name__ == "__main__":
    main()
