"""A trainer's one load into CUDA tensors, timed in fresh processes (docs/results/gpu.md,
"What the device load's pinned slabs cost"): pinning host memory costs about 0.6 ms per
MiB the first time in a process, and torch's caching host allocator hides it from a
process's later loads, which is what ``bench.py``'s repetitions measure.

Saves ``--tensors`` CUDA tensors of ``--mib`` MiB once, then for each
``load_staging_bytes`` in ``--staging-mib`` loads it ``--reps`` times, each load in a
process of its own (the settings interleaved, the page cache dropped before each load as
``bench.py`` does): the time of ``load`` from the call to the tensors being on the
device, pinning included. Without CUDA it runs on CPU tensors at tiny sizes (no pinning:
the figures mean nothing, the script stays tested).

    .venv/bin/python scripts/first_load.py --tensors 16 --mib 64 --staging-mib 64,256,1024 --reps 3
"""

from __future__ import annotations

__all__ = ["main"]

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import drop_page_cache  # noqa: E402

MiB = 1 << 20


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _request(tensors: int, elements: int, device: str) -> dict:
    from shardstore import ShardedTensor

    return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.empty(elements, device=device))
            for i in range(tensors)}


def load_once(ckpt: str, tensors: int, elements: int, staging_bytes: int) -> float:
    """One load in this (fresh) process: seconds from the call to the data on the device."""
    import shardstore
    from shardstore.engine.zarr_strategies import ZarrLoadShardedStrategy

    device = _device()
    request = _request(tensors, elements, device)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loaded = shardstore.load(request, ckpt, ZarrLoadShardedStrategy(load_staging_bytes=staging_bytes))
    if device == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - start
    for i in range(tensors):  # the values the parent saved
        assert torch.equal(loaded[f"t{i}"].cpu(), torch.full((elements,), float(i))), f"t{i}"
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=None)
    parser.add_argument("--mib", type=int, default=None)
    parser.add_argument("--staging-mib", default="64,256,1024")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        ckpt, tensors, elements, staging = args.child
        print(json.dumps(load_once(ckpt, int(tensors), int(elements), int(staging))))
        return

    import shardstore

    device = _device()
    tensors = args.tensors or (16 if device == "cuda" else 4)
    elements = (args.mib or (64 if device == "cuda" else 1)) * MiB // 4
    settings = [int(s) * MiB for s in args.staging_mib.split(",")]
    root = Path(tempfile.mkdtemp(prefix="first-load-"))
    try:
        ckpt = root / "ckpt"
        shardstore.save({f"t{i}": shardstore.ShardedTensor.from_rank_offsets(
            f"t{i}", torch.full((elements,), float(i), device=device)) for i in range(tensors)}, str(ckpt))
        files = [p for p in ckpt.rglob("*") if p.is_file()]
        times: dict[int, list[float]] = {s: [] for s in settings}
        how = ""
        for rep in range(args.reps):
            for staging in settings if rep % 2 == 0 else settings[::-1]:
                how = drop_page_cache(files)
                child = [sys.executable, __file__, "--child", str(ckpt), str(tensors), str(elements), str(staging)]
                out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
                times[staging].append(json.loads(out.strip().splitlines()[-1]))
        print(f"{device}: {tensors} tensors of {elements * 4 / MiB:.0f} MiB, a load per fresh process, "
              f"page cache dropped ({how}), {args.reps} each:")
        for staging, took in times.items():
            print(f"  first load, load_staging_bytes {staging // MiB:5d} MiB: "
                  f"{statistics.median(took):.3f} s ({min(took):.3f}-{max(took):.3f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
