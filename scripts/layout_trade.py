"""What packs and consolidated-only documents buy and cost, for many small tensors.

    PYTHONPATH=$PWD python scripts/layout_trade.py --count 10000 --reps 3 --root /tmp/trade

Saves ``--count`` float32 tensors of 1-64 KiB (256-16,384 elements, uniform; one
process) in each layout, ``--reps`` times, and loads each back with shardstore (warm
page cache); counts the files and directories each layout makes (on S3 each file is
one PUT); then reads every array once with ``scripts/plain_read.py`` (zarr-python
without shardstore's help: by path, through the root group, or from the pack). Prints
one line per layout: medians, and the fastest-slowest in brackets.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from shardstore import SaveOptions, ShardedTensor, load, save

LAYOUTS = {
    "a directory per array (per_node)": SaveOptions(),
    "consolidated_only": SaveOptions(zarr_metadata="consolidated_only"),
    "packs": SaveOptions(pack_arrays_up_to=65536),
    "packs + consolidated_only": SaveOptions(pack_arrays_up_to=65536, zarr_metadata="consolidated_only"),
}


def tensors(count: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    sizes = torch.randint(256, 16385, (count,), generator=gen).tolist()
    return {f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}


def entries(path: Path) -> tuple[int, int]:
    files = dirs = 0
    for _, dirnames, filenames in os.walk(path):
        files, dirs = files + len(filenames), dirs + len(dirnames)
    return files, dirs


def plain_read_s(path: Path) -> float:
    """Seconds ``scripts/plain_read.py`` takes to read every array, without shardstore."""
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    script = Path(__file__).resolve().parent / "plain_read.py"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-S", str(script), str(path)], check=True, env=env, stdout=subprocess.DEVNULL,
                   cwd=path.parent)
    return time.perf_counter() - start


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--root", type=Path, required=True)
    args = parser.parse_args()
    state = tensors(args.count)
    print(f"{args.count} float32 tensors, {sum(t.nbytes for t in state.values()) / 2**20:.0f} MiB, one process")
    for name, options in LAYOUTS.items():
        saves, loads = [], []
        path = args.root / name.replace(" ", "_")
        for _ in range(args.reps):
            shutil.rmtree(path, ignore_errors=True)
            start = time.perf_counter()
            save({k: ShardedTensor.from_rank_offsets(k, t) for k, t in state.items()}, str(path), options=options)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            load({k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t)) for k, t in state.items()}, str(path))
            loads.append(time.perf_counter() - start)
        files, dirs = entries(path)
        print(f"{name}: {files} files, {dirs} directories; save {spread(saves)}; load {spread(loads)}; "
              f"plain read {plain_read_s(path):.2f} s", flush=True)
        shutil.rmtree(path)


if __name__ == "__main__":
    main()
