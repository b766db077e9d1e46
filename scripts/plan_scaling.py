"""How save and load planning scale with the world size: one process, synthetic records.

For W ranks that each hold T tensors (every tensor sharded over all W ranks along
axis 0, as tensor parallelism does; one key in ten flattened as a distributed
optimizer's state, cut at uneven offsets), it measures:

* plan once (now): the coordinator gathers W x T records, validates and plans
  (``planner.plan_save``) and pickles each rank's part; a rank builds its own records
  and unpickles its part. Reported: coordinator CPU, per-rank CPU, bytes a rank
  receives, bytes the coordinator receives.
* every rank plans (before): each rank receives every rank's records (all-gather) and
  does the coordinator's work itself.
* load, plan once: the same records as the requests of a load at the same layout; the
  coordinator checks integrity and plans the fully-parallel reads
  (``validation.plan_load`` with ``planner.plan_reads``). Reported: coordinator CPU and
  bytes a rank receives (before: every rank all-gathered the requests twice).

Usage: ``python scripts/plan_scaling.py [--worlds 16 64 256 512 1024] [--tensors 1000 10000]
[--max-records 3000000]``; combinations above ``--max-records`` records are skipped
(they need several GB here), and the table says so.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardstore.layout import GlobalLayout, ShardRecord  # noqa: E402
from shardstore.planner import plan_reads, plan_save  # noqa: E402
from shardstore.validation import StrictHandling, plan_load, validate_sharding_integrity  # noqa: E402

ROWS_PER_RANK = 64
COLS = 256


def rank_records(rank: int, world: int, tensors: int) -> list[ShardRecord]:
    """What ``validation.local_records`` returns on ``rank``."""
    records = []
    rows = ROWS_PER_RANK * world
    for i in range(tensors):
        key = f"layers/{i}/weight"
        if i % 10 == 9:  # a distributed-optimizer state: one block, uneven flat cuts
            volume = rows * COLS
            cuts = [0] + [min(volume, r * (volume // world) + (r % 3)) for r in range(1, world)] + [volume]
            records.append(ShardRecord(f"optimizer/{i}", rank, i, "float32", (rows, COLS), (0, 0), (rows, COLS),
                                       (cuts[rank], cuts[rank + 1]), True))
        else:
            records.append(ShardRecord(key, rank, i, "bfloat16", (rows, COLS), (rank * ROWS_PER_RANK, 0),
                                       (ROWS_PER_RANK, COLS), None, True))
    return records


def measure(world: int, tensors: int) -> dict[str, float]:
    start = time.process_time()
    own = rank_records(0, world, tensors)
    records_cpu = time.process_time() - start
    own_bytes = len(pickle.dumps((own, [])))
    gathered = [(own, [])] + [(rank_records(r, world, tensors), []) for r in range(1, world)]
    gc.collect()

    start = time.process_time()
    layout = GlobalLayout.from_gathered(gathered)
    validate_sharding_integrity(layout)
    plans = plan_save(layout, 64 * 2**20, fully_parallel=True)
    plan_cpu = time.process_time() - start
    start = time.process_time()
    pickled = [pickle.dumps(p) for p in plans]
    pickle_cpu = time.process_time() - start
    start = time.process_time()
    pickle.loads(pickled[world // 2])
    unpickle_cpu = time.process_time() - start
    del layout, plans
    gc.collect()
    start = time.process_time()
    load_plans = plan_load(GlobalLayout.from_gathered(gathered), set(), StrictHandling.ASSUME_OK_UNEXPECTED, True,
                           lambda layout: plan_reads(layout, fully_parallel=True))
    load_pickled = [pickle.dumps(p) for p in load_plans]
    load_cpu = time.process_time() - start
    del load_plans, gathered
    gc.collect()
    return {
        "load_coordinator_s": load_cpu,
        "load_rank_rx_mb": len(load_pickled[world // 2]) / 1e6,
        "coordinator_s": plan_cpu + pickle_cpu,
        "rank_s": records_cpu + unpickle_cpu,
        "rank_rx_mb": len(pickled[world // 2]) / 1e6,
        "coordinator_rx_mb": own_bytes * world / 1e6,
        "before_rank_s": plan_cpu,  # every rank did the coordinator's planning
        "before_rank_rx_mb": own_bytes * world / 1e6,  # and received every rank's records
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[16, 64, 256, 512, 1024])
    parser.add_argument("--tensors", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--max-records", type=int, default=3_000_000)
    args = parser.parse_args()
    print("| tensors/rank | W | coordinator CPU s | per-rank CPU s | per-rank rx MB | coordinator rx MB "
          "| before: per-rank CPU s | before: per-rank rx MB | load: coordinator CPU s | load: per-rank rx MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tensors in args.tensors:
        for world in args.worlds:
            if world * tensors > args.max_records:
                print(f"| {tensors} | {world} | skipped ({world * tensors:,} records > --max-records) | | | | | | | |")
                continue
            m = measure(world, tensors)
            print(f"| {tensors} | {world} | {m['coordinator_s']:.2f} | {m['rank_s']:.3f} | {m['rank_rx_mb']:.2f} "
                  f"| {m['coordinator_rx_mb']:.1f} | {m['before_rank_s']:.2f} | {m['before_rank_rx_mb']:.1f} "
                  f"| {m['load_coordinator_s']:.2f} | {m['load_rank_rx_mb']:.4f} |",
                  flush=True)


if __name__ == "__main__":
    main()
