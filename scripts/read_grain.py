"""What the read grain buys and costs: arrays saved by 2 ranks, loaded by 2 and by 4.

    PYTHONPATH=$PWD .venv/bin/python scripts/read_grain.py --state llama --mib 1024 --reps 5
    PYTHONPATH=$PWD .venv/bin/python scripts/read_grain.py --state mixed --mib 124 --reps 3

States (``--state``, ``--mib`` in all): ``llama``, the Llama-shaped tensor-parallel state
of ``scripts/bench.py``'s ``large`` case (per layer a bf16 ``qkv`` of 8192 x 4096 split
along dim 0 and an fp32 ``fc2`` of 4096 x 4096 split along its last axis); ``mixed``,
ten float32 arrays of 1024 columns (two of each of 5 sizes, 1:2:4:8:16) split along dim
0 (FSDP2's ``Shard(0)``) and the same ten split along the last axis (tensor parallel).

Each round, for each layout (``--layouts``; the order rotates and reverses every other
round, so that the machine's slow phases fall on each alike), on a 4-rank gloo group
(127.0.0.1): ranks 0-1 save; ranks 0-1 load at the saving layout; all 4 load the
arrays of each split in turn. Each load starts with the checkpoint's pages dropped
(``posix_fadvise(DONTNEED)``) and is checked bit-exact; its bytes read are
``/proc/self/io``'s ``rchar`` across it (records included) over the bytes the rank
loads, the most of any rank. Prints, per layout, medians and (fastest-slowest) of the
save, the 2-rank load and the 4-rank load (rank 0's times; for the save and the 2-rank
load also rank 0's CPU time, all threads: less moved by other jobs), the bytes read per
split; then each time of the first layout over the others', median of the per-round
ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardstore import ShardedTensor, StorageLayout, load, save
from shardstore.format.storage_layout import LayoutSite
from shardstore.testing import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import faulted_in, large_shapes  # noqa: E402

LAYOUTS = {
    "read_grain 1 MiB": StorageLayout(read_grain=1 << 20),
    "whole chunks": StorageLayout(read_grain=None),
    "64 MiB shards": StorageLayout(shard_bytes=64 << 20, read_grain=None),
}
SPLITS = {0: "dim 0", 1: "last axis"}

Array = tuple[str, torch.dtype, tuple[int, int], int]  # key, dtype, global shape, split axis


def arrays(state: str, total_mib: float) -> list[Array]:
    """The arrays of ``state`` (module docstring), ``total_mib`` in all."""
    if state == "llama":
        return large_shapes(int(total_mib * 2**20), 2)
    unit = total_mib * 2**20 / (4 * 31)
    return [(f"{SPLITS[axis].replace(' ', '_')}/layer{i}/{size}", torch.float32,
             (max(8, int(unit * size / 4096) // 8 * 8), 1024), axis)
            for axis in SPLITS for size in (1, 2, 4, 8, 16) for i in range(2)]


def full(key: str, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen).to(dtype)


def part(array: Array, rank: int, world: int) -> torch.Tensor:
    key, dtype, shape, axis = array
    return full(key, dtype, shape).chunk(world, axis)[rank].contiguous()


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


class Loads:
    """One rank's loads of ``arrays`` at ``world`` ranks into targets made once (as a
    trainer's tensors exist before its load), with what each read."""

    def __init__(self, chosen: list[Array], rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.expected = {a[0]: part(a, rank, world) for a in chosen}
        self.targets = faulted_in({a[0]: ShardedTensor.from_rank_offsets(
            a[0], torch.empty_like(self.expected[a[0]]), (a[3], rank, world)) for a in chosen})

    def run(self, path: Path, group: dist.ProcessGroup | None) -> tuple[float, float, float]:
        """Seconds, CPU seconds and bytes read / bytes loaded of one load, checked bit-exact."""
        before, start, cpu = read_chars(), time.perf_counter(), time.process_time()
        loaded = load(self.targets, str(path), process_group=group)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        ratio = (read_chars() - before) / sum(t.numel() * t.element_size() for t in self.expected.values())
        for key, want in self.expected.items():
            assert torch.equal(loaded[key].view(torch.uint8), want.view(torch.uint8)), (path, key)
        return seconds, cpu, ratio


def worker(rank: int, world: int, port: int, root: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    savers = dist.new_group([0, 1])
    every = arrays(args.state, args.mib)
    blocks = {a[0]: ShardedTensor.from_rank_offsets(a[0], part(a, rank, 2), (a[3], rank, 2))
              for a in every} if rank < 2 else {}
    at_two = Loads(every, rank, 2) if rank < 2 else None
    at_four = {axis: Loads([a for a in every if a[3] == axis], rank, world)
               for axis in SPLITS if any(a[3] == axis for a in every)}
    names = args.layouts
    figures: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in names}
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order[::-1] if rep % 2 else order:
            got, path = figures[name], Path(root) / f"{name.replace(' ', '_')}-{rep}"
            if rank < 2:
                dist.barrier(savers)
                start, cpu = time.perf_counter(), time.process_time()
                save(blocks, str(path), process_group=savers, layout=LAYOUTS[name])
                got["save"].append(time.perf_counter() - start)
                got["save CPU"].append(time.process_time() - cpu)
            dist.barrier()
            drop(path)
            dist.barrier()
            if at_two is not None:
                seconds, cpu, ratio = at_two.run(path, savers)
                got["load at 2"].append(seconds)
                got["load at 2 CPU"].append(cpu)
                got["read at 2"].append(ratio)
            dist.barrier()
            total = 0.0
            for axis, loads in at_four.items():
                drop(path)
                dist.barrier()
                seconds, _, ratio = loads.run(path, None)
                total += seconds
                ratios = [0.0] * world
                dist.all_gather_object(ratios, ratio)
                got[f"read 2 -> 4, {SPLITS[axis]}"].append(max(ratios))
            got["load 2 -> 4"].append(total)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    if rank == 0:
        default = StorageLayout().chosen_for(LayoutSite(world_size=2)).read_grain
        print(f"{args.state}: {args.mib:g} MiB, {len(every)} arrays, {args.reps} rounds; the default read_grain: "
              f"{default}")
        for name in names:
            line = [f"{name:16}"]
            for what, values in figures[name].items():
                unit = "x" if what.startswith("read") else " s"
                line.append(f"{what} {statistics.median(values):.3f}{unit} ({min(values):.3f}-{max(values):.3f})")
            print("; ".join(line), flush=True)
        first, *others = names
        for other in others:  # paired by round: the machine's phases fall on both alike
            line = [f"{first} / {other}, median of per-round ratios (range)"]
            for what in (w for w in figures[first] if not w.startswith("read")):
                ratios = [a / b for a, b in zip(figures[first][what], figures[other][what])]
                line.append(f"{what} {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
            print("; ".join(line), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state", choices=("llama", "mixed"), default="llama")
    parser.add_argument("--mib", type=float, default=1024, help="global bytes of all arrays, MiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layouts", default="read_grain 1 MiB,whole chunks",
                        help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    args.layouts = args.layouts.split(",")
    unknown = set(args.layouts) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}: pick from {list(LAYOUTS)}")
    root = tempfile.mkdtemp(prefix="read-grain-", dir=os.environ.get("BENCH_DIR"))
    try:
        mp.spawn(worker, args=(4, free_port(), root, args), nprocs=4)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
