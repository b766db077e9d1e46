"""Bytes a load of a whole-tensor checkpoint reads, each rank its own part or each chunk once.

A checkpoint saved by one process (a TP 1 or data-parallel job: one block per array,
unsharded chunks of at most 64 MiB) loaded by FSDP2 at N ranks, each asking for its rows
of every array: the real planner (``ZarrLoadShardedStrategy.plan_load``, writing and
reading nothing) with ``read_shards_once`` off and on. An unsharded chunk is read whole
(its crc32c covers all of it), so a rank reads every chunk its blocks touch; with
``read_shards_once`` a chunk's reader also reads the blocks it forwards. Prints the
bytes all ranks read over the bytes they asked for, the most one rank reads, and the
coordinator's planning CPU seconds.

Usage: ``python scripts/whole_tensor_loads.py [--ranks 512] [--layers 2] [--quick]``.
"""

from __future__ import annotations

__all__ = ["bytes_read", "main"]

import argparse
import gc
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulate_scale as sim  # noqa: E402

from shardstore.engine.zarr_strategies import ZarrLoadShardedStrategy  # noqa: E402
from shardstore.format.chunks import chunk_pieces  # noqa: E402
from shardstore.format.records import ArrayRecord, CommitRecord  # noqa: E402
from shardstore.planning.layout import GatheredShards, ShardRecord  # noqa: E402
from shardstore.planning.plans import RankReadPlan, plan_save, planned_requests  # noqa: E402


def _layout(model: sim.FsdpLlama) -> GatheredShards:
    return GatheredShards.from_gathered([(model.rank_records(r), []) for r in range(model.world)])


def _chunks(block: ShardRecord, array: ArrayRecord) -> set[tuple[str, tuple[int, ...]]]:
    """The chunks ``block`` touches."""
    return {(block.key, piece.index) for piece in chunk_pieces(block.region, array.shape, array.chunk_shape)}


def bytes_read(layout: GatheredShards, record: CommitRecord, plans: list[RankReadPlan]) -> list[int]:
    """Per rank, the bytes of the chunks its reads touch (its own requests and the
    blocks it forwards), each chunk once, as stored (edge chunks padded whole)."""
    own: list[dict[int, ShardRecord]] = [{} for _ in plans]
    for records in layout.tensors.values():
        for s in records:
            own[s.rank][s.index] = s
    out = []
    for rank, plan in enumerate(plans):
        requests = planned_requests(plan, [own[rank][i] for i in range(len(own[rank]))])
        blocks = [requests[i] for i in plan.reads]
        touched = set().union(*(_chunks(b, record.arrays[b.key]) for b in blocks))
        out.append(sum(math.prod(record.arrays[key].chunk_shape) * record.arrays[key].itemsize for key, _ in touched))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a tiny model at 8 ranks, in seconds")
    args = parser.parse_args()
    model = sim.layouts(quick=True)[0] if args.quick else sim.FsdpLlama(args.ranks, layers=args.layers)
    record = plan_save(_layout(sim.FsdpLlama(1, **_shape_of(model))), 64 << 20, True, None)[0].commit
    layout = _layout(model)
    asked = sum(s.nbytes for records in layout.tensors.values() for s in records)
    print(f"{model.name}, {model.layers} layers, saved whole by 1 rank, loaded by {model.world}: "
          f"{asked / 1e9:.2f} GB asked for")
    gc.collect()
    gc.disable()
    for once in (False, True):
        start = time.process_time()
        plans = ZarrLoadShardedStrategy(read_shards_once=once).plan_load(layout, record)
        seconds = time.process_time() - start
        read = bytes_read(layout, record, plans)
        print(f"  read_shards_once={once!s:5}: all ranks read {sum(read) / 1e9:8.2f} GB ({sum(read) / asked:5.2f}x), "
              f"the most one rank reads {max(read) / 1e9:6.2f} GB, plan {seconds:.2f} s CPU")


def _shape_of(model: sim.FsdpLlama) -> dict:
    """``model``'s shape and name, without its world size."""
    return {f: getattr(model, f) for f in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "dtype", "name")}


if __name__ == "__main__":
    main()
