"""What an async save of gathered arrays blocks for and holds (docs/measurements/
performance.md, "Async saves of gathered arrays").

``--world`` ranks (gloo on 127.0.0.1) each hold ``--arrays`` float32 blocks of
``--block-mib`` MiB of arrays split along their rows, saved ``--reps`` times with
``async_sharded_save=True`` into shards of ``--shard-mib`` MiB (so the blocks are
gathered across ranks in the staging stage). Per rank: the time ``save`` blocks
(median, min-max) and the peak of the resident set above its level before the save
(``VmHWM`` after ``clear_refs``; Linux), the background write included.
``--max-staging-mib``: each repetition saves twice, interleaved, without and with that
``max_staging_bytes`` (the shards a rank assembles are then exchanged in waves of a
quarter of it); ``--sync``: synchronous saves, the bound as ``sync_staging_bytes``.
``--own-arrays``: each rank also holds that many arrays of its own (one block of
``--block-mib`` MiB each, written whole by it: copied for an async save, in copy waves
under the bound, before the exchange).

    .venv/bin/python scripts/async_sharded.py --world 2 --arrays 16 --block-mib 16 --reps 5
    .venv/bin/python scripts/async_sharded.py --world 4 --arrays 8 --block-mib 8 --max-staging-mib 64
"""

from __future__ import annotations

__all__ = ["main"]

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardstore import ShardedTensor, save
from shardstore.engine.zarr_strategies import ZarrSaveShardedStrategy
from shardstore.format.records import read_commit_record
from shardstore.format.sharding import ShardingIndexed
from shardstore.stores.locations import open_location
from shardstore.testing import free_port

MiB = 1 << 20


def _peak_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, root: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = args.block_mib * MiB // (4 * 1024)
    state = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.full((rows, 1024), float(i + rank)),
                                                      (0, rank, world)) for i in range(args.arrays)}
    state.update({f"own{rank}_{i}": ShardedTensor.from_rank_offsets(f"own{rank}_{i}", torch.full((rows, 1024), 0.5 + i))
                  for i in range(args.own_arrays)})
    bounds = [None] if args.max_staging_mib is None else [None, args.max_staging_mib * MiB]
    runs: dict[int | None, list[tuple[float, int]]] = {bound: [] for bound in bounds}
    for rep in range(args.reps):
        for bound in bounds if rep % 2 == 0 else bounds[::-1]:
            if args.sync:
                strategy = ZarrSaveShardedStrategy(shard_bytes=args.shard_mib * MiB, sync_staging_bytes=bound or 1 << 40)
            else:
                strategy = ZarrSaveShardedStrategy(shard_bytes=args.shard_mib * MiB, max_staging_bytes=bound)
            _reset_peak()
            before = _peak_bytes()
            start = time.perf_counter()
            request = save(state, f"{root}/{rep}-{bound}", strategy, async_sharded_save=not args.sync)
            blocked = time.perf_counter() - start
            if request is not None:
                request.execute_sync()
            runs[bound].append((blocked, _peak_bytes() - before))
    if rank == 0:  # what is measured: arrays whose blocks were gathered into shards
        arrays = read_commit_record(open_location(f"{root}/0-None")).arrays
        plain = sorted(key for key, record in arrays.items()
                       if key.startswith("w") and not isinstance(record.codec, ShardingIndexed))
        if plain:
            raise SystemExit(f"arrays not gathered into shards, so not what this measures: {plain}")
    out[rank] = runs
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--arrays", type=int, default=16)
    parser.add_argument("--block-mib", type=int, default=16)
    parser.add_argument("--shard-mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-staging-mib", type=int, default=None)
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--own-arrays", type=int, default=0)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="async-sharded-")
    try:
        out = mp.Manager().dict()
        mp.spawn(_rank, args=(args.world, free_port(), args, root, out), nprocs=args.world, join=True)
        for rank in sorted(out):
            for bound, runs in out[rank].items():
                blocked = [b for b, _ in runs]
                peaks = [p / MiB for _, p in runs]
                label = "no bound" if bound is None else f"bound {bound // MiB} MiB"
                print(f"rank {rank}, {label}: {'took' if args.sync else 'blocked'} {statistics.median(blocked):.3f} s "
                      f"({min(blocked):.3f}-{max(blocked):.3f}); "
                      f"peak above start {statistics.median(peaks):.0f} MiB ({min(peaks):.0f}-{max(peaks):.0f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        os.sync()


if __name__ == "__main__":
    main()
