"""What a load at another layout reads: arrays saved by 2 ranks, loaded by 4.

    PYTHONPATH=$PWD .venv/bin/python scripts/read_grain.py            # 248 MiB, 3 reps
    PYTHONPATH=$PWD .venv/bin/python scripts/read_grain.py --mib 62 --reps 1

Ten float32 arrays (two of each of 5 sizes, 1:2:4:8:16; ``--mib`` in all), saved by
ranks 0-1 of a 4-rank gloo group (127.0.0.1) and loaded by all 4, split along dim 0
(FSDP2's ``Shard(0)``) or along the last axis (tensor parallel, ``[out, in/TP]``), in
each of three layouts: the default, chunks read whole (``read_grain=None``, the
default before it) and 64 MiB shards. Each load starts with the checkpoint's pages
dropped (``posix_fadvise(DONTNEED)``); it reports the bytes read (``/proc/self/io``
``rchar``: every byte the process's reads returned, records included) over the bytes
the rank loads, the maximum over ranks, and the save's and rank 0's load's times
(medians over ``--reps``).
Every load is checked bit-exact.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardstore import ShardedTensor, StorageLayout, load, save
from shardstore.testing import free_port

LAYOUTS = {
    "default": StorageLayout(),
    "whole chunks": StorageLayout(read_grain=None),
    "64 MiB shards": StorageLayout(shard_bytes=64 << 20),
}


def arrays(total_mib: float) -> dict[str, tuple[int, int]]:
    """Global shapes ``(rows, 1024)`` float32: two arrays of each of 5 sizes, 1:2:4:8:16."""
    unit = total_mib * 2**20 / (2 * 31)
    return {f"layer{i}/{size}": (max(8, int(unit * size / 4096) // 8 * 8), 1024)
            for size in (1, 2, 4, 8, 16) for i in range(2)}


def full(key: str, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))


def block(key: str, shape: tuple[int, int], axis: int, rank: int, world: int, empty: bool) -> ShardedTensor:
    local = full(key, shape).chunk(world, axis)[rank]
    local = torch.empty_like(local) if empty else local.contiguous()
    return ShardedTensor.from_rank_offsets(key, local, (axis, rank, world))


def read_chars() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def drop(path: Path) -> None:
    os.sync()
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def worker(rank: int, world: int, port: int, root: str, total_mib: float, reps: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    savers = dist.new_group([0, 1])
    shapes = arrays(total_mib)
    for split, axis in (("dim 0", 0), ("last axis", 1)):
        for name, layout in LAYOUTS.items():
            ratios, save_times, load_times = [], [], []
            for rep in range(reps):
                path = Path(root) / f"{split}-{name}-{rep}".replace(" ", "_")
                if rank < 2:
                    sd = {k: block(k, s, axis, rank, 2, empty=False) for k, s in shapes.items()}
                    dist.barrier(savers)
                    start = time.perf_counter()
                    save(sd, str(path), process_group=savers, layout=layout)
                    save_times.append(time.perf_counter() - start)
                dist.barrier()
                drop(path)
                dist.barrier()
                want = {k: block(k, s, axis, rank, world, empty=True) for k, s in shapes.items()}
                before, start = read_chars(), time.perf_counter()
                loaded = load(want, str(path))
                load_times.append(time.perf_counter() - start)
                ratio = (read_chars() - before) / sum(t.data.nbytes for t in want.values())
                for k, s in shapes.items():
                    assert torch.equal(loaded[k], full(k, s).chunk(world, axis)[rank]), (split, name, k)
                every = [0.0] * world
                dist.all_gather_object(every, ratio)
                ratios.append(max(every))
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(path)
            if rank == 0:
                print(f"{split:9} {name:14} read/loaded {statistics.median(ratios):.2f}x "
                      f"(reps {', '.join(f'{r:.2f}' for r in ratios)}); save {statistics.median(save_times):.3f} s "
                      f"(reps {', '.join(f'{t:.3f}' for t in save_times)}); rank 0's load "
                      f"{statistics.median(load_times):.3f} s", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=248, help="global bytes of all arrays, MiB")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="read-grain-", dir=os.environ.get("BENCH_DIR"))
    try:
        mp.spawn(worker, args=(4, free_port(), root, args.mib, args.reps), nprocs=4)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
