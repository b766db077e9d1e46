"""Files of a checkpoint planned with and without sharded arrays (issue 44.1).

Plans saves of ``scripts/simulate_scale.py``'s layouts (sampled at a few layers) with the
real planner (``planning.plans.plan_save``), once with every block a chunk file and once
with ``shard_bytes`` (``ZarrSaveShardedStrategy(shard_bytes=...)``), writing nothing, and
prints per layout: checkpoint bytes, arrays, arrays sharded, data files, the issue's
target (bytes / shard size + 2 x arrays + ranks: data files plus ``zarr.json`` files
plus per-rank files), bytes the gather moves between ranks, how many ranks write and the
most one writes, the coordinator's planning seconds, and what a load at the save's
layout fetches over what it asks for on a local disk (``same_layout_fetched``: every
main shard read once, as a fully-parallel load reads it).

``--record`` also builds the commit record of each sharded save at full size (issue
44.2): the sampled plan's record, bound with a report per written shard as the writers
send them (``simulate_scale.commit_stage``), copied under every layer's keys
(``simulate_scale.full_size_record``), then written and parsed as a load parses it
(``CommitRecord.to_json`` / ``from_json``, the garbage collector paused); prints its
size and the median CPU seconds of ``--parses`` parses.

``--loads`` instead prints the S3 requests of a load of each sharded save at its own
layout (``load_requests``), each rank reading its part of every shard, and each shard
read once for all (``ZarrLoadShardedStrategy(read_shards_once=...)``).

Usage: ``python scripts/sharded_plan_counts.py [--shard-mib 64] [--quick] [--record | --loads]``.
"""

from __future__ import annotations

__all__ = ["assembly_waves", "counts", "load_requests", "main", "same_layout_fetched", "sharded_record"]

import argparse
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulate_scale as sim  # noqa: E402

from shardstore.engine.zarr_strategies import (  # noqa: E402
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_SYNC_STAGING_BYTES,
)
from shardstore.execution.save import assembly_wave_bytes  # noqa: E402
from shardstore.format.codecs import BYTES_CRC32C, CRC_BYTES  # noqa: E402
from shardstore.format.records import ArrayRecord, CommitRecord  # noqa: E402
from shardstore.format.sharding import ShardIndex, ShardingIndexed  # noqa: E402
from shardstore.gc_pause import gc_paused  # noqa: E402
from shardstore.planning.layout import GatheredShards, ShardRecord  # noqa: E402
from shardstore.planning.plans import (  # noqa: E402
    RankReadPlan,
    exchange_waves,
    plan_reads,
    plan_save,
    planned_requests,
)
from shardstore.stores.kv_chunks import KvChunkStore  # noqa: E402

MiB = 1 << 20


def counts(model: sim.Model, shard_bytes: int | None) -> dict[str, float]:
    """One plan of ``model``'s save: the figures the module docstring lists."""
    layout = GatheredShards.from_gathered([(model.rank_records(r), []) for r in range(model.world)])
    start = time.perf_counter()
    plans = plan_save(layout, DEFAULT_MAX_CHUNK_BYTES, True, shard_bytes)
    seconds = time.perf_counter() - start
    arrays = plans[0].commit.arrays
    written = [0] * model.world
    moved = 0
    for plan in plans:
        for _, chunk in plan.straddling:
            if chunk.writer == plan.rank:
                itemsize = arrays[chunk.key].itemsize
                written[plan.rank] += sum(hi - lo for _, _, lo, hi, _ in chunk.pieces) * itemsize
                moved += sum(hi - lo for rank, _, lo, hi, _ in chunk.pieces if rank != plan.rank) * itemsize
    nbytes = plans[0].checkpoint_nbytes
    fetched, needed = same_layout_fetched(layout, arrays)
    waves, per_wave = assembly_waves(plans, arrays, DEFAULT_SYNC_STAGING_BYTES)
    return {
        "bytes": nbytes, "arrays": len(arrays),
        "sharded": sum(1 for a in arrays.values() if a.codec != BYTES_CRC32C),
        "data_files": sum(a.chunk_count for a in arrays.values()),
        "target": -(-nbytes // (shard_bytes or 64 * MiB)) + 2 * len(arrays) + model.world,
        "moved": moved, "writers": sum(1 for w in written if w), "max_written": max(written), "plan_s": seconds,
        "fetched_ratio": fetched / needed, "waves": waves, "max_per_wave": per_wave,
    }


def assembly_waves(plans: list, arrays: dict[str, ArrayRecord], bound: int) -> tuple[int, int]:
    """The exchange waves of a sync save under ``bound`` (``sync_staging_bytes``;
    ``execution.save.stage_save``) and the most bytes one rank assembles in one of them."""
    wave_bytes = assembly_wave_bytes(bound)
    most, count = 0, 1
    for plan in plans:
        waves = exchange_waves(plan, wave_bytes)
        count = len(waves)
        for wave in waves:
            mine = sum(c.volume * arrays[c.key].itemsize for _, c in wave if c.writer == plan.rank)
            most = max(most, mine)
    return count, most


def _read_box(s: ShardRecord) -> list[tuple[int, int]]:
    """The box of the array a load of ``s`` reads (``execution.load.plan_read``): its
    block, or for a flattened range the block's rows (first axis longer than one) it
    touches."""
    box = [(o, o + b) for o, b in zip(s.offset, s.block_shape)]
    if s.flat_range is not None and s.block_shape:
        axis = next((a for a, b in enumerate(s.block_shape) if b > 1), len(s.block_shape) - 1)
        row = math.prod(s.block_shape[axis + 1 :])
        start = s.offset[axis]
        box[axis] = (start + s.flat_range[0] // row, start + -(-s.flat_range[1] // row))
    return box


def _units(box: list[tuple[int, int]], unit: tuple[int, ...]) -> list[range]:
    """Along each axis, the indices of the units (chunks) of ``unit`` that ``box`` overlaps."""
    return [range(lo // u, -(-hi // u)) for (lo, hi), u in zip(box, unit)]


def _fetched(s: ShardRecord, array: ArrayRecord) -> int:
    """Bytes a local load of ``s`` fetches: the whole chunks its box overlaps; in a
    sharded array, per shard the inner chunks it overlaps and the crc table and index,
    or the whole shard where that adds at most a quarter (``read_boxes_into``)."""
    box = _read_box(s)
    if not isinstance(array.codec, ShardingIndexed):
        return math.prod(map(len, _units(box, array.chunk_shape))) * math.prod(array.chunk_shape) * array.itemsize
    inner, step = array.codec.chunk_shape, array.codec.inner_nbytes
    count = math.prod(c // i for c, i in zip(array.chunk_shape, inner))
    total = 0
    for shard in itertools.product(*_units(box, array.chunk_shape)):
        lo = [i * c for i, c in zip(shard, array.chunk_shape)]
        part = [(max(a, o), min(b, o + c)) for (a, b), o, c in zip(box, lo, array.chunk_shape)]
        needed = math.prod(map(len, _units(part, inner)))
        whole = (count - needed) * step <= needed * step // 4
        total += count * (step + CRC_BYTES) if whole else needed * (step + CRC_BYTES)
        total += ShardIndex.suffix_nbytes(count)
    return total


def same_layout_fetched(layout: GatheredShards, arrays: dict[str, ArrayRecord]) -> tuple[int, int]:
    """Bytes a load at the save's layout fetches from a local disk, and the bytes it
    asks for: every main shard read once (a fully-parallel load reads each replicated
    block once and sends it on)."""
    fetched = needed = 0
    for key, shards in layout.tensors.items():
        for s in shards:
            if s.main and s.nbytes:
                fetched, needed = fetched + _fetched(s, arrays[key]), needed + s.nbytes
    return fetched, needed


def load_requests(layout: GatheredShards, arrays: dict[str, ArrayRecord], once: bool) -> dict[str, float]:
    """A load at the save's layout from S3, planned by the real planner
    (``plan_reads``, fully parallel, with or without ``read_shards_once``): the data
    GETs all ranks make (per rank and shard it reads: one where it reads the shard
    whole, as ``read_boxes_into`` does when that wastes at most a quarter of what it
    needs or 8 MiB, else a suffix GET for the index and a ranged GET), the bytes they
    fetch, the bytes sent between ranks, the most one rank reads for others only, and
    the coordinator's planning seconds."""
    shards = {k: a.chunk_shape for k, a in arrays.items() if isinstance(a.codec, ShardingIndexed)} if once else None
    start = time.perf_counter()
    plans = plan_reads(layout, True, shards)
    seconds = time.perf_counter() - start
    own: list[dict[int, ShardRecord]] = [{} for _ in plans]
    for records in layout.tensors.values():
        for s in records:
            own[s.rank][s.index] = s
    numbered = [planned_requests(plan, [own[plan.rank][i] for i in range(len(own[plan.rank]))]) for plan in plans]

    def request(plan: RankReadPlan, i: int) -> ShardRecord:  # index ``i`` of ``plan``: own, a piece or a forward
        return numbered[plan.rank][i]

    gets = fetched = sent = most_forwarded = 0
    for plan in plans:
        wanted: dict[tuple, set[int]] = {}  # (key, shard) -> inner chunks this rank reads
        for i in plan.reads:
            s = request(plan, i)
            array = arrays[s.key]
            if not isinstance(array.codec, ShardingIndexed):
                gets += math.prod(map(len, _units(_read_box(s), array.chunk_shape)))
                fetched += _fetched(s, array)
                continue
            _add_inner_chunks(s, array, wanted)
        for (key, _), needed in wanted.items():
            array = arrays[key]
            count = math.prod(c // i for c, i in zip(array.chunk_shape, array.codec.chunk_shape))
            step = array.codec.inner_nbytes
            waste = (count - len(needed)) * step
            whole = waste <= max(len(needed) * step // 4, KvChunkStore.request_bytes)
            gets += 1 if whole else 2
            fetched += (count if whole else len(needed)) * (step + CRC_BYTES) + ShardIndex.suffix_nbytes(count)
        for _, indices in plan.sends:
            sent += sum(request(plan, i).nbytes for i in indices)
        most_forwarded = max(most_forwarded, sum(f.nbytes for f in plan.forwards))
    return {"gets": gets, "fetched": fetched, "sent": sent, "most_forwarded": most_forwarded, "plan_s": seconds}


def _add_inner_chunks(s: ShardRecord, array: ArrayRecord, wanted: dict[tuple, set[int]]) -> None:
    """Adds to ``wanted`` (by ``(key, shard)``) the inner chunks the box ``s`` reads covers."""
    box, inner = _read_box(s), array.codec.chunk_shape
    per_shard = [c // i for c, i in zip(array.chunk_shape, inner)]
    for shard in itertools.product(*_units(box, array.chunk_shape)):
        lo = [i * c for i, c in zip(shard, array.chunk_shape)]
        part = [(max(a, o) - o, min(b, o + c) - o) for (a, b), o, c in zip(box, lo, array.chunk_shape)]
        cells = wanted.setdefault((s.key, shard), set())
        for at in itertools.product(*_units(part, inner)):
            cells.add(int(np.ravel_multi_index(at, per_shard)))


def sharded_record(sampled: sim.Model, model: sim.Model, shard_bytes: int, parses: int) -> dict[str, float]:
    """The commit record of ``model``'s sharded save, built from ``sampled``'s plan (the
    same world, fewer layers) at ``model``'s layer count: its bytes, its shards, and the
    median and range of ``parses`` parses' CPU seconds."""
    layout = GatheredShards.from_gathered([(sampled.rank_records(r), []) for r in range(sampled.world)])
    plans = plan_save(layout, DEFAULT_MAX_CHUNK_BYTES, True, shard_bytes)
    bound, _, _ = sim.commit_stage(plans)
    del plans, layout
    record = sim.full_size_record(bound, sampled.layers, model.layers, model.world) or bound
    data = record.to_json()
    seconds = []
    for _ in range(parses):
        start = time.process_time()
        gc_paused(CommitRecord.from_json)(data, sim.PLACE)
        seconds.append(time.process_time() - start)
    return {"layers": model.layers if record is not bound else sampled.layers, "arrays": len(record.arrays),
            "chunks": sum(a.chunk_count for a in record.arrays.values()), "bytes": len(data),
            "parse_s": statistics.median(seconds), "parse_min_s": min(seconds), "parse_max_s": max(seconds)}


def print_records(models: list[sim.Model], shard_bytes: int, quick: bool, parses: int) -> None:
    """``sharded_record`` of each FSDP2 layout (Megatron's layer-stacked keys do not name
    their layer, so its record cannot be copied to full size from a sample)."""
    print("\n| layout | ranks | layers | arrays | shards in the record | record | parse (median, min-max) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for model in models:
        if isinstance(model, sim.MegatronGpt):
            continue
        sampled = model if quick else model.with_layers(2)
        r = sharded_record(sampled, model, shard_bytes, parses)
        print(f"| {model.name} | {model.world} | {r['layers']} | {r['arrays']:,} | {r['chunks']:,} "
              f"| {r['bytes'] / 1e6:.2f} MB | {r['parse_s']:.3f} s ({r['parse_min_s']:.3f}-{r['parse_max_s']:.3f}) |",
              flush=True)


def print_loads(models: list[sim.Model], shard_bytes: int, quick: bool) -> None:
    """``load_requests`` of each layout's sharded save, each rank reading its own part
    of every shard and with ``read_shards_once``."""
    print("\n| layout | ranks | layers | shards read | data GETs | fetched / asked | sent between ranks "
          "| most one rank reads for others | plan s |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for model in models:
        sampled = model if quick else model.with_layers(16 if isinstance(model, sim.MegatronGpt) else 2)
        layout = GatheredShards.from_gathered([(sampled.rank_records(r), []) for r in range(sampled.world)])
        arrays = plan_save(layout, DEFAULT_MAX_CHUNK_BYTES, True, shard_bytes)[0].commit.arrays
        asked = sum(s.nbytes for records in layout.tensors.values() for s in records if s.main)
        for once in (False, True):
            r = load_requests(layout, arrays, once)
            print(f"| {sampled.name} | {sampled.world} | {sampled.layers} | {'once' if once else 'by each rank'} "
                  f"| {r['gets']:,} | {r['fetched'] / asked:.3f} | {r['sent'] / 1e9:.2f} GB "
                  f"| {r['most_forwarded'] / 1e6:.0f} MB | {r['plan_s']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard-mib", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="small worlds, seconds")
    parser.add_argument("--record", action="store_true", help="also the full-size sharded commit records")
    parser.add_argument("--records-only", action="store_true", help="only the full-size sharded commit records")
    parser.add_argument("--parses", type=int, default=5, help="parses of each record timed")
    parser.add_argument("--loads", action="store_true", help="only the S3 requests of sharded loads")
    args = parser.parse_args()
    models = sim.layouts(args.quick)
    if args.loads:
        print_loads(models, args.shard_mib * MiB, args.quick)
        return
    if args.records_only:
        print_records(models, args.shard_mib * MiB, args.quick, args.parses)
        return
    print("| layout | ranks | layers | shards | bytes | arrays | sharded | data files | target | moved | "
          "writers | most written | waves | most per wave | plan s | load fetched / asked |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in models:
        layers = 16 if isinstance(model, sim.MegatronGpt) else 4 if model.world <= 512 else 2
        sampled = model if args.quick else model.with_layers(layers)
        for shard_bytes in (None, args.shard_mib * MiB):
            c = counts(sampled, shard_bytes)
            print(f"| {sampled.name} | {sampled.world} | {sampled.layers} | {f'{args.shard_mib} MiB' if shard_bytes else 'none'} "
                  f"| {c['bytes'] / 1e9:.1f} GB | {c['arrays']} | {c['sharded']} | {c['data_files']:,} | {c['target']:,} "
                  f"| {c['moved'] / 1e9:.1f} GB | {c['writers']} | {c['max_written'] / 1e6:.0f} MB | {c['waves']} "
                  f"| {c['max_per_wave'] / 1e6:.0f} MB | {c['plan_s']:.2f} "
                  f"| {c['fetched_ratio']:.3f} |",
                  flush=True)
    if args.record:
        print_records(models, args.shard_mib * MiB, args.quick, args.parses)


if __name__ == "__main__":
    main()
