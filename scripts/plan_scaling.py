"""How save and load planning scale with the world size: one process, synthetic records.

For W ranks that each hold T tensors (every tensor sharded over all W ranks along
axis 0, as tensor parallelism does; one key in ten flattened as a distributed
optimizer's state, cut at uneven offsets), it measures:

* plan once (now): the coordinator gathers W x T records, validates and plans
  (``planning.plans.plan_save``) and pickles each rank's part; a rank builds its own records
  and unpickles its part. Reported: coordinator CPU, per-rank CPU, bytes a rank
  receives, bytes the coordinator receives.
* every rank plans (before): each rank receives every rank's records (all-gather) and
  does the coordinator's work itself.
* load, plan once: the same records as the requests of a load at the same layout; the
  coordinator checks integrity and plans the fully-parallel reads
  (``validation.plan_load`` with ``planning.plans.plan_reads``). Every rank parses the commit
  record the save would have written (a checksum per chunk) itself. Reported:
  coordinator CPU, per-rank CPU (its records, the record parse, its plan), and bytes a
  rank receives (before: every rank all-gathered the requests twice).
* ``--cached``: the save's plan stage reusing a cached plan (``protocol.plan_cache``):
  a rank builds its records and compares them (and its rank, the world size, the
  planner's settings) with those of its cached part, then sends only the plan's id;
  the coordinator unpickles W such queries, checks that every id is the same and that
  the target stores the plan's names, and pickles W replies. Reported next to the
  full plan stage: coordinator CPU (here including the unpickling of the W gathered
  record lists, which the save table leaves out) and per-rank CPU, and the bytes the
  coordinator receives.

Usage: ``python scripts/plan_scaling.py [--worlds 16 64 256 512 1024] [--tensors 1000 10000]
[--max-records 3000000] [--cached]``. The garbage collector is paused during each measurement, as
``save`` and ``load`` pause it (``core.gc_paused``). Combinations above ``--max-records`` records are skipped
(they need several GB here), and the table says so.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardstore.format.records import CommitRecord  # noqa: E402
from shardstore.gc_pause import gc_paused  # noqa: E402
from shardstore.planning.checks import admits_names, name_lengths_needed  # noqa: E402
from shardstore.planning.layout import GatheredShards, ShardRecord  # noqa: E402
from shardstore.planning.plans import plan_reads, plan_save  # noqa: E402
from shardstore.protocol.plan_cache import _CachedPlanQuery  # noqa: E402
from shardstore.stores.base import NameLimits  # noqa: E402
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


def full_record(save_plans: list) -> CommitRecord:
    """The commit record the save would write (every chunk's checksum bound; spread
    over 32 bits, as real ones are, for a realistic size)."""
    commit = save_plans[0].commit
    arrays = {
        k: replace(a, chunk_crcs=tuple((0x9E3779B1 * (i + 1)) % 2**32 for i in range(a.chunk_count)))
        for k, a in commit.arrays.items()
    }
    return replace(commit, arrays=arrays, save_id="simulated")


def measure_cached(world: int, tensors: int) -> dict[str, float]:
    """The plan stage of a save with the full plan and with a cached one (``--cached``)."""
    settings = (64 * 2**20, True)
    own = rank_records(world // 2, world, tensors)
    cached_key = pickle.loads(pickle.dumps((world // 2, world, settings, tuple(own), ())))  # equal, not identical
    gathered = [pickle.dumps(("/ckpt", (rank_records(r, world, tensors), []), None)) for r in range(world)]
    gc.collect()

    start = time.process_time()  # the full stage: the coordinator unpickles, checks, plans, pickles the parts
    layout = GatheredShards.from_gathered([pickle.loads(g)[1] for g in gathered])
    validate_sharding_integrity(layout)
    plans = plan_save(layout, *settings)
    needed = name_lengths_needed(layout)
    pickled = [pickle.dumps(("plan-id", None, p)) for p in plans]
    full_coordinator = time.process_time() - start
    start = time.process_time()  # a rank: its records, pickled, and its part unpickled
    records = rank_records(world // 2, world, tensors)
    pickle.dumps(("/ckpt", (records, []), None))
    pickle.loads(pickled[world // 2])
    full_rank = time.process_time() - start
    del layout, plans, pickled
    gc.collect()

    start = time.process_time()  # a rank, cached: its records compared, a query sent, the reply read
    records = rank_records(world // 2, world, tensors)
    same = (world // 2, world, settings, tuple(records), ()) == cached_key
    query = pickle.dumps(_CachedPlanQuery("/ckpt", "plan-id" if same else None, None))
    reply = pickle.dumps((True, "intent", []))
    pickle.loads(reply)
    cached_rank = time.process_time() - start
    assert same
    queries = [query] * world
    start = time.process_time()  # the coordinator, cached: W queries, one decision, W replies
    received = [pickle.loads(q) for q in queries]
    reuse = len({q.plan_id for q in received}) == 1 and admits_names(NameLimits(255, 4000), needed)
    replies = [pickle.dumps((reuse, "intent", [])) for _ in range(world)]
    cached_coordinator = time.process_time() - start
    del replies, gathered
    gc.collect()
    return {
        "full_coordinator_s": full_coordinator, "full_rank_s": full_rank,
        "full_coordinator_rx_mb": len(pickle.dumps(("/ckpt", (own, []), None))) * world / 1e6,
        "cached_coordinator_s": cached_coordinator, "cached_rank_s": cached_rank,
        "cached_coordinator_rx_mb": len(query) * world / 1e6,
    }


def measure(world: int, tensors: int) -> dict[str, float]:
    start = time.process_time()
    own = rank_records(0, world, tensors)
    records_cpu = time.process_time() - start
    own_bytes = len(pickle.dumps((own, [])))
    gathered = [(own, [])] + [(rank_records(r, world, tensors), []) for r in range(1, world)]
    gc.collect()

    start = time.process_time()
    layout = GatheredShards.from_gathered(gathered)
    validate_sharding_integrity(layout)
    plans = plan_save(layout, 64 * 2**20, fully_parallel=True)
    plan_cpu = time.process_time() - start
    start = time.process_time()
    pickled = [pickle.dumps(p) for p in plans]
    pickle_cpu = time.process_time() - start
    start = time.process_time()
    pickle.loads(pickled[world // 2])
    unpickle_cpu = time.process_time() - start
    rank_rx = len(pickled[world // 2])
    record_json = full_record(plans).to_json()
    del layout, plans, pickled
    gc.collect()

    start = time.process_time()  # the coordinator plans the reads
    load_plans = plan_load(GatheredShards.from_gathered(gathered), set(), StrictHandling.ASSUME_OK_UNEXPECTED, True,
                           lambda layout: plan_reads(layout, fully_parallel=True))
    load_pickled = [pickle.dumps(p) for p in load_plans]
    load_cpu = time.process_time() - start
    start = time.process_time()  # a rank reads the whole commit record, then its plan
    CommitRecord.from_json(record_json, "simulated")
    parse_cpu = time.process_time() - start
    start = time.process_time()
    pickle.loads(load_pickled[world // 2])
    load_rank_cpu = time.process_time() - start
    del load_plans, gathered
    gc.collect()
    return {
        "coordinator_s": plan_cpu + pickle_cpu,
        "rank_s": records_cpu + unpickle_cpu,
        "rank_rx_mb": rank_rx / 1e6,
        "coordinator_rx_mb": own_bytes * world / 1e6,
        "before_rank_s": plan_cpu,  # every rank did the coordinator's planning
        "before_rank_rx_mb": own_bytes * world / 1e6,  # and received every rank's records
        "load_coordinator_s": load_cpu,
        "load_rank_s": records_cpu + parse_cpu + load_rank_cpu,
        "load_rank_parse_s": parse_cpu,
        "load_rank_rx_mb": len(load_pickled[world // 2]) / 1e6,
        "record_mb": len(record_json) / 1e6,
    }


def measured_rows(
    args: argparse.Namespace, measure_one: Callable[[int, int], dict[str, float]]
) -> list[tuple[int, int, dict[str, float] | None]]:
    """``measure_one(world, tensors)`` for every size asked for (None past ``--max-records``)."""
    rows: list[tuple[int, int, dict[str, float] | None]] = []
    for tensors in args.tensors:
        for world in args.worlds:
            m = None if world * tensors > args.max_records else gc_paused(measure_one)(world, tensors)
            rows.append((tensors, world, m))
            print(f"measured {tensors} tensors/rank at W={world}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[16, 64, 256, 512, 1024])
    parser.add_argument("--tensors", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--max-records", type=int, default=3_000_000)
    parser.add_argument("--cached", action="store_true", help="only the save's plan stage, full and cached")
    args = parser.parse_args()
    if args.cached:
        print_table("Save, plan stage: full and cached", measured_rows(args, measure_cached), [
            ("full: coordinator CPU s", "full_coordinator_s", ".2f"), ("full: per-rank CPU s", "full_rank_s", ".3f"),
            ("full: coordinator rx MB", "full_coordinator_rx_mb", ".1f"),
            ("cached: coordinator CPU s", "cached_coordinator_s", ".4f"),
            ("cached: per-rank CPU s", "cached_rank_s", ".3f"),
            ("cached: coordinator rx MB", "cached_coordinator_rx_mb", ".3f"),
        ])
        return
    rows = measured_rows(args, measure)
    print_table("Save", rows, [
        ("coordinator CPU s", "coordinator_s", ".2f"), ("per-rank CPU s", "rank_s", ".3f"),
        ("per-rank rx MB", "rank_rx_mb", ".2f"), ("coordinator rx MB", "coordinator_rx_mb", ".1f"),
        ("before: per-rank CPU s", "before_rank_s", ".2f"), ("before: per-rank rx MB", "before_rank_rx_mb", ".1f"),
    ])
    print_table("Load", rows, [
        ("commit record MB", "record_mb", ".1f"), ("coordinator CPU s", "load_coordinator_s", ".2f"),
        ("per-rank CPU s", "load_rank_s", ".3f"), ("of which: record parse s", "load_rank_parse_s", ".3f"),
        ("per-rank rx MB", "load_rank_rx_mb", ".4f"),
    ])


def print_table(title: str, rows: list[tuple[int, int, dict[str, float] | None]],
                columns: list[tuple[str, str, str]]) -> None:
    """One markdown table: a row per (tensors, W), ``columns`` as (heading, key, format)."""
    print(f"\n{title}:\n")
    print("| tensors/rank | W | " + " | ".join(heading for heading, _, _ in columns) + " |")
    print("|---:|---:|" + "---:|" * len(columns))
    for tensors, world, m in rows:
        if m is None:
            cells = [f"skipped ({world * tensors:,} records > --max-records)"] + [""] * (len(columns) - 1)
        else:
            cells = [format(m[key], spec) for _, key, spec in columns]
        print(f"| {tensors} | {world} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
