"""What the cached plan saves per save, on real gloo ranks of this machine.

Each of W ranks holds T small tensors, every one sharded over the W ranks along axis 0
(tensor parallelism; a 1 x 16 float32 block per rank), and saves it with
``ZarrSaveShardedStrategy(cache_plan=True)`` (the plan of the first save is reused by
the next ones) and with a strategy without the cache. Reported, per save: the wall
time of the plan stage (``protocol.plan_cache.gather_and_plan_cached``: records,
gather, validate, plan, begin, scatter) on the coordinator and on rank 1, the median
of ``--repeats`` saves, and the bytes one rank sends to the coordinator in that stage
(pickled, as ``gather_object`` sends them).

Usage: ``python scripts/plan_cache.py [--worlds 2 4] [--tensors 1000 5000] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

COLS = 16


def _state_dict(rank: int, world: int, tensors: int, step: int) -> dict:
    from shardstore import ShardedTensor

    return {
        f"layers/{i}/weight": ShardedTensor.from_rank_offsets(
            f"layers/{i}/weight", torch.full((1, COLS), float(step + rank)), (0, rank, world))
        for i in range(tensors)
    } | {"iteration": step}


def _measure(rank: int, world: int, tensors: int, repeats: int, root: str) -> dict[str, Any]:
    """On every rank: the plan stage's wall time (s) and bytes sent, cached and not."""
    import shardstore.execution.pipeline as pipeline  # where the save's plan stage is called
    from shardstore import save
    from shardstore.engine.zarr_strategies import ZarrSaveShardedStrategy
    from shardstore.protocol.collectives import Group

    timed, sent, counting = [], [], [False]
    plan_stage, gather = pipeline.gather_and_plan_cached, Group.gather_object

    def timed_plan_stage(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return plan_stage(*args, **kwargs)
        finally:
            timed.append(time.perf_counter() - start)

    def counted_gather(self: Group, obj: Any) -> list[Any]:
        if counting[0]:
            sent.append(len(pickle.dumps(obj)))
        return gather(self, obj)

    pipeline.gather_and_plan_cached, Group.gather_object = timed_plan_stage, counted_gather
    cached = ZarrSaveShardedStrategy(cache_plan=True)
    uncached = ZarrSaveShardedStrategy()
    step = 0

    def one_save(strategy: ZarrSaveShardedStrategy, count: bool = False) -> tuple[float, int]:
        nonlocal step
        step += 1
        timed.clear()
        sent.clear()
        counting[0] = count
        save(_state_dict(rank, world, tensors, step), f"{root}/{step}", sharded_strategy=strategy)
        counting[0] = False
        return timed[0], sent[0] if sent else 0  # the plan stage's gather is the save's first

    first_s, _ = one_save(cached)
    reused_s = [one_save(cached)[0] for _ in range(repeats)]
    uncached_s = [one_save(uncached)[0] for _ in range(repeats)]
    _, reused_bytes = one_save(cached, count=True)
    _, uncached_bytes = one_save(uncached, count=True)
    assert cached.plan_cache.planned == 1, "the cached plan was not reused"
    return {
        "first_s": first_s, "reused_s": statistics.median(reused_s), "uncached_s": statistics.median(uncached_s),
        "reused_bytes": reused_bytes, "uncached_bytes": uncached_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tensors", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from tests.dist import run_distributed

    print("| W | tensors/rank | plan stage, coordinator: planned / reused ms | rank 1: planned / reused ms "
          "| sent by a rank: planned / reused bytes |")
    print("|---:|---:|---:|---:|---:|")
    for world in args.worlds:
        for tensors in args.tensors:
            with tempfile.TemporaryDirectory() as root:
                results = run_distributed(_measure, world, tensors, args.repeats, root, timeout=1800)
            coordinator, rank1 = results[0], results[1]
            print(f"| {world} | {tensors} | {coordinator['uncached_s'] * 1e3:.0f} / {coordinator['reused_s'] * 1e3:.0f} "
                  f"| {rank1['uncached_s'] * 1e3:.0f} / {rank1['reused_s'] * 1e3:.0f} "
                  f"| {rank1['uncached_bytes']:,} / {rank1['reused_bytes']:,} |", flush=True)


if __name__ == "__main__":
    main()
