"""Scale by simulation (issue 44 item 2): what a save and a load of a realistic layout
cost in files, S3 requests, bytes between ranks, planning CPU and commit record, planned
in ONE process from synthetic per-rank shard records, without writing tensor data.

Layouts (``layouts()``): FSDP2 Llama-70B-shaped with AdamW (every parameter and both
moments ``Shard(0)`` over all ranks, as ``shardstore.inputs.dtensors.blocks_at`` cuts
them; ``step`` is a plain tensor, so common state) at 512 and 4,096 ranks; Megatron
GPT-175B-shaped, TP=8, PP=8, DP=16, layer-stacked arrays, the distributed optimizer's
``fp32_param``/``exp_avg``/``exp_avg_sq`` as flattened fragments of each rank's bucketed
buffer over DP. ``--quick``: small worlds, in seconds.

The real code runs on the synthetic records: ``planning.checks.check_layout`` and
``planning.plans.plan_save`` (the coordinator's plan stage), ``execution.save.
bind_chunks`` and ``format.records.CommitRecord.to_json``/``from_json`` (the commit
record as written, every chunk's crc32c and XXH3-128 digest, and the parse every rank
of a load makes), ``validation.plan_load`` with ``planning.plans.plan_reads`` (a load at
the same layout: chunk GETs, and the bytes they fetch against those asked for).
Messages between ranks are measured pickled as ``protocol.collectives.Group`` frames
them, padded as its gather and scatter pad them.

Every save is planned with the layout shardstore chooses when given none
(``layout_files.chosen_layout``: ``StorageLayout().chosen_for(LayoutSite(...))``, as a
save chooses it), through the strategy's own ``plan_save``, for each door
(``layout_files.DOORS``: ``shardstore.save``, Megatron's ``install()``, DCP's
``ShardstoreWriter``, the last modelled with a process group of its own for the
exchange) on a local file system and on S3; doors that choose the same layout share a
plan. Files are counted from the planned records (``layout_files.planned_files``: a
file per chunk or shard of every array not packed, a pack per rank that packs, a
``zarr.json`` per array and group unless consolidated only, and the root documents),
and set against issue 65's bound: bytes / shard size + 2 x arrays + ranks.

S3 requests per save and load come from a fit (``S3Costs``): real saves and loads on a
local S3 server (moto, 127.0.0.1; counted by its request recorder) at a few tiny
layouts give requests per chunk written or read, per array, per rank and per save; a
further layout checks the fit. ``--no-s3`` skips it (``--quick`` does).

Where a layout has more than ``--max-records`` shard records, it is planned at two
reduced layer counts and every figure extrapolated linearly in the layer count (exact
for counts: layers are alike; CPU is an estimate); the commit record is then built at
full size by copying the sampled layers' array records under every layer's key, so its
size and parse time are measured, not extrapolated. ``--check-extrapolation`` also
extrapolates the layouts planned whole, and prints sampled / whole for the figures.

Usage: ``python scripts/simulate_scale.py [--quick] [--no-s3] [--max-records N]
[--check-extrapolation] [--per-array] [--json PATH]`` (``--per-array``: each block a
chunk file, no packs, a ``zarr.json`` per array, instead of the chosen layout).
"""

from __future__ import annotations

__all__ = ["FsdpLlama", "MegatronGpt", "S3Costs", "simulate", "simulate_sampled", "simulate_whole"]

import argparse
import bisect
import functools
import gc
import itertools
import json
import math
import pickle
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from layout_files import DOORS, LayoutFiles, bound, chosen_layout, files_by_door, plan_with  # noqa: E402

from shardstore.engine.zarr_strategies import ZarrLoadShardedStrategy  # noqa: E402
from shardstore.execution.save_commit import bind_chunks  # noqa: E402
from shardstore.format.chunks import WrittenChunk  # noqa: E402
from shardstore.format.config import CONFIG_FNAME  # noqa: E402
from shardstore.format.records import COMMON_FILE, ArrayRecord, CommitRecord  # noqa: E402
from shardstore.format.storage_layout import StorageLayout  # noqa: E402
from shardstore.gc_pause import gc_paused  # noqa: E402
from shardstore.planning.checks import check_layout  # noqa: E402
from shardstore.planning.layout import GatheredShards, ShardRecord  # noqa: E402
from shardstore.planning.plans import RankReadPlan, RankSavePlan, plan_reads  # noqa: E402
from shardstore.planning.plans.read_plans import leading_rows, request_piece  # noqa: E402
from shardstore.validation import StrictHandling, plan_load  # noqa: E402

MiB = 2**20
PLACE = "s3://bucket/checkpoints/iter_0001000"  # what every rank names in the plan stage
FRAME = 8  # bytes of the length before each pickled message (protocol.collectives)


# --- layouts -------------------------------------------------------------------------


class Model(Protocol):
    """A layout: how many ranks, and what each rank's shard records are."""

    name: str
    layers: int

    @property
    def world(self) -> int: ...

    def with_layers(self, layers: int) -> Model: ...

    def sample_layers(self) -> tuple[int, int]: ...

    def rank_records(self, rank: int) -> list[ShardRecord]: ...


@cache
def _fsdp_block(rows: int, world: int, rank: int) -> tuple[int, int] | None:
    """``(offset, rows)`` of ``rank``'s ``Shard(0)`` block of a tensor of ``rows`` rows
    over ``world`` ranks, as ``inputs.dtensors.blocks_at`` gives it (torch's uneven
    chunking: the last ranks hold fewer rows or none)."""
    from torch.distributed.tensor import Shard

    from shardstore.inputs.dtensors import blocks_at

    blocks = blocks_at((rows,), (world,), (rank,), (Shard(0),))
    return (blocks[0].global_offset[0], blocks[0].shape[0]) if blocks else None


def _record(key: str, rank: int, index: int, dtype: str, shape: tuple[int, ...], offset: tuple[int, ...],
            block: tuple[int, ...], main: bool, flat: tuple[int, int] | None = None) -> ShardRecord:
    """A rank's record as ``ShardRecord.from_sharded_tensor`` makes it (irregular where
    the block is no cell of a regular grid, as ``inputs.dtensors`` marks it)."""
    regular = all(n and o % n == 0 and g % n == 0 for o, n, g in zip(offset, block, shape))
    return ShardRecord(key, rank, index, dtype, shape, offset, block, flat, main, irregular=not regular)


@dataclass(frozen=True)
class FsdpLlama:
    """FSDP2 (``fully_shard``) over ``ranks``, a Llama-shaped model with AdamW, as
    ``get_state_dict`` hands it over: every parameter and its two moments are DTensors
    ``Shard(0)`` over all ranks, keyed as DCP names them."""

    ranks: int
    layers: int = 80
    hidden: int = 8192
    ffn: int = 28672
    heads: int = 64
    kv_heads: int = 8
    vocab: int = 128256
    dtype: str = "float32"
    name: str = "FSDP2 Llama-70B"

    @property
    def world(self) -> int:
        return self.ranks

    def with_layers(self, layers: int) -> FsdpLlama:
        return replace(self, layers=layers)

    def sample_layers(self) -> tuple[int, int]:
        return (2, 4)

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        per_layer = [("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (kv, h)),
                     ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, h)),
                     ("mlp.gate_proj.weight", (self.ffn, h)), ("mlp.up_proj.weight", (self.ffn, h)),
                     ("mlp.down_proj.weight", (h, self.ffn)), ("input_layernorm.weight", (h,)),
                     ("post_attention_layernorm.weight", (h,))]
        layers = [(f"model.layers.{i}.{n}", s) for i in range(self.layers) for n, s in per_layer]
        return [("model.embed_tokens.weight", (self.vocab, h)), *layers, ("model.norm.weight", (h,)),
                ("lm_head.weight", (self.vocab, h))]

    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        params = self.parameters()
        moments = [(f"optim.state.{k}.{m}", s) for k, s in params for m in ("exp_avg", "exp_avg_sq")]
        return [*params, *moments]

    def rank_records(self, rank: int) -> list[ShardRecord]:
        records = []
        for key, shape in self.arrays():
            block = _fsdp_block(shape[0], self.ranks, rank)
            if block is None:  # an empty shard: a placeholder, no ShardedTensor
                continue
            offset, rows = block
            records.append(_record(key, rank, len(records), self.dtype, shape, (offset, *(0,) * (len(shape) - 1)),
                                   (rows, *shape[1:]), main=True))
        return records


@dataclass(frozen=True)
class LayerParam:
    """One parameter of a Megatron transformer layer: its TP-local shape and how TP
    splits it (``axis`` None: replicated over TP)."""

    name: str
    shape: tuple[int, ...]
    axis: int | None


@dataclass(frozen=True)
class MegatronGpt:
    """Megatron-Core GPT (TE layer spec) with TP x PP x DP and the distributed optimizer.

    Layer parameters are stacked arrays ``decoder.layers.<name>`` of global shape
    ``(layers, ...)``; each rank holds its stage's layers, TP-split, replicated over DP.
    The optimizer state (``fully_sharded_model_space``): each (TP, PP) rank's parameters
    fill buckets of ``bucket_elements`` in order, each bucket padded and cut into DP equal
    parts; a DP rank holds the fragments of its parts as flattened ranges of the blocks.
    Rank order: TP fastest, then DP, then PP (Megatron's default)."""

    tp: int = 8
    pp: int = 8
    dp: int = 16
    layers: int = 96
    hidden: int = 12288
    ffn: int = 49152
    vocab: int = 51200
    bucket_elements: int = 40_000_000
    name: str = "Megatron GPT-175B"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def with_layers(self, layers: int) -> MegatronGpt:
        return replace(self, layers=layers)

    def sample_layers(self) -> tuple[int, int]:
        return (self.pp, 2 * self.pp)

    def layer_params(self) -> list[LayerParam]:
        h, f, t = self.hidden, self.ffn, self.tp
        return [
            LayerParam("self_attention.linear_qkv.layer_norm_weight", (h,), None),
            LayerParam("self_attention.linear_qkv.layer_norm_bias", (h,), None),
            LayerParam("self_attention.linear_qkv.weight", (3 * h // t, h), 0),
            LayerParam("self_attention.linear_qkv.bias", (3 * h // t,), 0),
            LayerParam("self_attention.linear_proj.weight", (h, h // t), 1),
            LayerParam("self_attention.linear_proj.bias", (h,), None),
            LayerParam("mlp.linear_fc1.layer_norm_weight", (h,), None),
            LayerParam("mlp.linear_fc1.layer_norm_bias", (h,), None),
            LayerParam("mlp.linear_fc1.weight", (f // t, h), 0),
            LayerParam("mlp.linear_fc1.bias", (f // t,), 0),
            LayerParam("mlp.linear_fc2.weight", (h, f // t), 1),
            LayerParam("mlp.linear_fc2.bias", (h,), None),
        ]

    def stage_blocks(self, tp: int, pp: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]]:
        """``(key, global shape, offset, block, split over TP)`` of every parameter block a
        rank at ``(tp, pp)`` holds, in its buffer's order."""
        per_stage = self.layers // self.pp
        blocks = []
        if pp == 0:  # vocab-parallel embedding (tied with the output layer)
            rows = self.vocab // self.tp
            blocks.append(("embedding.word_embeddings.weight", (self.vocab, self.hidden), (tp * rows, 0),
                           (rows, self.hidden), True))
        for layer in range(pp * per_stage, (pp + 1) * per_stage):
            for p in self.layer_params():
                shape = tuple(n * self.tp if a == p.axis else n for a, n in enumerate(p.shape))
                offset = tuple(tp * n if a == p.axis else 0 for a, n in enumerate(p.shape))
                blocks.append((f"decoder.layers.{p.name}", (self.layers, *shape), (layer, *offset), (1, *p.shape),
                               p.axis is not None))
        if pp == self.pp - 1:
            for name in ("weight", "bias"):
                blocks.append((f"decoder.final_layernorm.{name}", (self.hidden,), (0,), (self.hidden,), False))
        return blocks

    def dp_fragments(self, volumes: list[int], dp: int) -> list[tuple[int, int, int]]:
        """``(block number, flat start, flat stop)`` of DP rank ``dp``'s part of the
        bucketed buffer of blocks of ``volumes`` elements."""
        buckets, start, filled = [], 0, 0
        for i, v in enumerate(volumes):
            filled += v
            if filled >= self.bucket_elements or i == len(volumes) - 1:
                buckets.append((start, i + 1))
                start, filled = i + 1, 0
        fragments = []
        for first, stop in buckets:
            offsets = list(itertools.accumulate(volumes[first:stop], initial=0))
            part = -(-offsets[-1] // (self.dp * 128)) * 128
            lo, hi = dp * part, (dp + 1) * part
            for j in range(bisect.bisect_right(offsets, lo) - 1, stop - first):
                a, b = max(lo, offsets[j]), min(hi, offsets[j + 1])
                if a >= hi:
                    break
                if a < b:
                    fragments.append((first + j, a - offsets[j], b - offsets[j]))
        return fragments

    def rank_records(self, rank: int) -> list[ShardRecord]:
        tp, dp, pp = rank % self.tp, rank // self.tp % self.dp, rank // (self.tp * self.dp)
        blocks = self.stage_blocks(tp, pp)
        records = [_record(k, rank, i, "bfloat16", s, o, b, main=dp == 0 and (split or tp == 0))
                   for i, (k, s, o, b, split) in enumerate(blocks)]
        fragments = self.dp_fragments([math.prod(b[3]) for b in blocks], dp)
        for state in ("fp32_param", "exp_avg", "exp_avg_sq"):
            for number, lo, hi in fragments:
                key, shape, offset, block, split = blocks[number]
                records.append(_record(f"optimizer.state.{state}.{key}", rank, len(records), "float32", shape,
                                       offset, block, main=split or tp == 0, flat=(lo, hi)))
        return records


def layouts(quick: bool) -> list[Model]:
    """The layouts of a run (``--quick``: the same shapes, small)."""
    if quick:
        tiny = dict(layers=2, hidden=256, ffn=512, heads=8, kv_heads=2, vocab=1000, name="FSDP2 Llama-tiny")
        return [FsdpLlama(8, **tiny), FsdpLlama(32, **tiny),
                MegatronGpt(tp=2, pp=2, dp=2, layers=4, hidden=256, ffn=1024, vocab=1024, bucket_elements=100_000,
                            name="Megatron GPT-tiny")]
    return [FsdpLlama(512), FsdpLlama(4096), MegatronGpt()]


# --- S3 requests ---------------------------------------------------------------------

S3_METHODS = ("PUT", "GET", "HEAD", "LIST", "DELETE", "POST")
# What each fitted coefficient counts requests per.
S3_TERMS = ("chunk", "array", "rank", "operation")


def fitted_requests(coefficients: dict[str, tuple[float, ...]], terms: tuple[int, ...]) -> dict[str, int]:
    """Requests of each method for ``terms`` (chunks, arrays, ranks, 1)."""
    return {m: round(sum(c * t for c, t in zip(coef, terms))) for m, coef in coefficients.items()}


@dataclass(frozen=True)
class S3Costs:
    """Requests of each method per chunk written or read, per array, per rank and per
    operation (``S3_TERMS``), fitted to real saves and loads on a local S3 server."""

    save: dict[str, tuple[float, ...]]
    load: dict[str, tuple[float, ...]]
    check: str

    def requests(self, op: str, chunks: int, arrays: int, ranks: int) -> dict[str, int]:
        return fitted_requests(getattr(self, op), (chunks, arrays, ranks, 1))


def _s3_state(rank: int, world: int, arrays: int, rows: int) -> dict:
    import torch

    from shardstore import ShardedTensor

    return {f"a{i}": ShardedTensor.from_rank_offsets(f"a{i}", torch.ones(rows, 4), (0, rank, world))
            for i in range(arrays)}


def _s3_worker(rank: int, world: int, port: int, op: str, url: str, arrays: int, rows: int, chunk: int) -> None:
    import torch.distributed as dist

    import shardstore
    from shardstore import StorageLayout
    from shardstore.engine.zarr_strategies import ZarrSaveShardedStrategy

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    state = _s3_state(rank, world, arrays, rows)
    if op == "save":
        # every chunk an object of its own: the fit's cost per object (the simulated
        # layouts count packs and shards as objects too), not the packs' per rank
        layout = StorageLayout(max_chunk_bytes=chunk, pack_arrays_up_to=0)
        shardstore.save(state, url, ZarrSaveShardedStrategy(layout=layout))
    else:
        shardstore.load(state, url)
    if world > 1:
        dist.destroy_process_group()


def _recorded(server, run: Callable[[], None], path: Path) -> dict[str, int]:
    """Requests by method (``LIST``: a GET that lists) that ``run`` makes to ``server``."""
    import urllib.request

    def recorder(action: str) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{server.endpoint}/moto-api/recorder/{action}",
                                                      data=b"", method="POST")).read()

    path.unlink(missing_ok=True)
    recorder("start-recording")
    try:
        run()
    finally:
        recorder("stop-recording")
    counts = dict.fromkeys(S3_METHODS, 0)
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        method = "LIST" if entry["method"] == "GET" and "list-type=" in entry.get("url", "") else entry["method"]
        counts[method] = counts.get(method, 0) + 1
    return counts


def calibrate_s3(workdir: Path) -> S3Costs:
    """Saves and loads on a local S3 server (moto, 127.0.0.1) at tiny layouts
    ``(ranks, arrays, rows per rank, max chunk bytes)``; a least-squares fit of requests
    per chunk, array, rank and operation (``fit_costs``), checked on one more layout."""
    import os

    import torch.multiprocessing as mp

    from shardstore.testing import LocalS3Server, free_port

    record = workdir / "moto-recording.jsonl"
    saved_environment = dict(os.environ)
    os.environ["MOTO_RECORDER_FILEPATH"] = str(record)
    fits = [(1, 2, 4, 1 << 20), (1, 4, 4, 1 << 20), (1, 2, 8, 32), (2, 2, 4, 1 << 20), (2, 3, 8, 64)]
    check = (2, 5, 8, 32)
    rows_of: dict[str, list] = {"save": [], "load": []}
    try:
        with LocalS3Server() as server:
            server.create_bucket("simulate")
            server.export_environment()
            for n, (world, arrays, rows, chunk) in enumerate([*fits, check]):
                url = f"s3://simulate/c{n}"
                chunks = world * arrays * -(-rows * 16 // chunk)  # 4 float32 columns: 16 bytes a row
                for op in ("save", "load"):
                    args = (world, free_port(), op, url, arrays, rows, chunk)
                    run = functools.partial(_s3_worker, 0, *args) if world == 1 else functools.partial(
                        mp.spawn, _s3_worker, args=args, nprocs=world, join=True)
                    rows_of[op].append(((chunks, arrays, world, 1), _recorded(server, run, record)))
    finally:  # the server and its endpoint are gone
        os.environ.clear()
        os.environ.update(saved_environment)
    return fit_costs(rows_of, f"check layout {check}")


def fit_costs(rows_of: dict[str, list[tuple[tuple[int, ...], dict[str, int]]]], check: str) -> S3Costs:
    """Least squares of each method's requests over ``(chunks, arrays, ranks, 1)``, on
    every row but the last of each operation; the last is predicted as a check."""
    import numpy as np

    costs, checks = {}, []
    for op, rows in rows_of.items():
        terms = np.array([t for t, _ in rows[:-1]], dtype=float)
        coefs = {}
        for method in [m for m in S3_METHODS if any(m in c for _, c in rows)]:
            counts = np.array([c.get(method, 0) for _, c in rows[:-1]], dtype=float)
            fit = np.linalg.lstsq(terms, counts, rcond=None)[0]
            coefs[method] = tuple(round(float(x), 3) + 0.0 for x in fit)  # + 0.0: no "-0.0"
        costs[op] = coefs
        (chunks, arrays, world, _), measured = rows[-1]
        predicted = fitted_requests(coefs, (chunks, arrays, world, 1))
        checks.append(f"{op}: measured {sum(measured.values())}, fitted {sum(predicted.values())}")
    return S3Costs(costs["save"], costs["load"], f"{check}: " + "; ".join(checks))


# --- one layout ----------------------------------------------------------------------


def _framed(obj: object) -> int:
    """Bytes of ``obj`` as ``protocol.collectives.Group`` sends it."""
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) + FRAME


def _chunk_index(region, chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s.start // c for s, c in zip(region, chunk_shape))


def written_chunks(plan: RankSavePlan, arrays: dict[str, ArrayRecord], rng: random.Random) -> list[WrittenChunk]:
    """What rank ``plan.rank`` reports at the commit: every chunk it writes (its whole
    blocks, its direct flat chunks, the straddling chunks and the shards it assembles),
    with a random crc32c and digest as real ones are spread."""
    out = []

    def report(key: str, index: tuple[int, ...]) -> None:
        out.append(WrittenChunk(key, index, rng.getrandbits(32), f"{rng.getrandbits(128):032x}"))

    for s in plan.shards:
        if s.flat_range is not None or s.key in plan.gathered:  # a block of a shard: its writer reports
            continue
        c = arrays[s.key].chunk_shape
        ends = [min(o + b, g) for o, b, g in zip(s.offset, s.block_shape, s.global_shape)]
        for index in itertools.product(*(range(o // n, -(-e // n)) for o, e, n in zip(s.offset, ends, c))):
            report(s.key, index)
    for w in plan.flat_direct:
        report(w.key, _chunk_index(w.region, arrays[w.key].chunk_shape))
    for _, chunk in plan.straddling:
        if chunk.writer == plan.rank:
            report(chunk.key, _chunk_index(chunk.region, arrays[chunk.key].chunk_shape))
    return out


def _straddle_bytes(plans: list[RankSavePlan], arrays: dict[str, ArrayRecord]) -> int:
    """Tensor bytes the straddling chunks' pieces travel to their assemblers."""
    total = 0
    for plan in plans:
        for _, chunk in plan.straddling:
            if chunk.writer == plan.rank:
                itemsize = arrays[chunk.key].itemsize
                total += sum((hi - lo) * itemsize for r, _, lo, hi, _ in chunk.pieces if r != plan.rank)
    return total


def _chunk_reads(by_rank: list[list[ShardRecord]], arrays: dict[str, ArrayRecord], reads: list) -> tuple[int, int, int]:
    """Chunk GETs of a load at the save's layout (``by_rank``: each rank's requests),
    the bytes they fetch and the bytes the ranks asked for. A rank fetches each chunk
    (or shard) it reads from once, however many of its blocks, pieces or forwards it
    reads from there (neighbouring ranges of one object are one request); a block read
    covers whole chunks; flattened ranges fetch every chunk they overlap, whole, once."""
    gets = fetched = needed = 0
    for plan in reads:
        mine = by_rank[plan.rank]
        fetched_from: set[tuple[str, tuple[int, ...]]] = set()
        for index in plan.reads.reads:
            record = _read_record(mine, plan.reads, index)
            array = arrays[record.key]
            chunks = _chunks_of(record, array)
            if record.flat_range is None:
                fetched += record.nbytes
            else:
                fetched += sum(array.chunk_nbytes(c) for c in chunks if (record.key, c) not in fetched_from)
            fetched_from.update((record.key, chunk) for chunk in chunks)
            needed += record.nbytes
        gets += len(fetched_from)
    return gets, fetched, needed


def _read_record(mine: list[ShardRecord], plan: RankReadPlan, index: int) -> ShardRecord:
    """What read ``index`` of a rank's plan reads: one of its own requests, one of its
    pieces (part of a request, cut at a chunk's edge) or a block it forwards."""
    if index < len(mine):
        return mine[index]
    if index < len(mine) + len(plan.pieces):
        whole, box = plan.pieces[index - len(mine)]
        return request_piece(mine[whole], box, index)
    return plan.forwards[index - plan.requested]


def _chunks_of(s: ShardRecord, array: ArrayRecord) -> list[tuple[int, ...]]:
    """The grid indices of the chunks of ``array`` that the shard ``s`` overlaps (a
    flattened range: those that the rows of its block it covers overlap)."""
    c = array.chunk_shape
    if s.flat_range is None:  # the chunk grid is aligned with every block
        ends = [min(o + b, g) for o, b, g in zip(s.offset, s.block_shape, s.global_shape)]
        return list(itertools.product(*(range(o // n, -(-e // n)) for o, e, n in zip(s.offset, ends, c))))
    lo, hi = s.flat_range
    if hi <= lo:
        return []
    axis, first, last, _ = leading_rows(s)
    ranges = [range(o // n, (o + max(b, 1) - 1) // n + 1) for o, b, n in zip(s.offset, s.block_shape, c)]
    ranges[axis] = range(first // c[axis], last // c[axis] + 1)
    return list(itertools.product(*ranges))


@dataclass
class Figures:
    """Everything measured for one layout (sizes in bytes, times in CPU seconds)."""

    layout: str
    ranks: int
    layers: int
    extrapolated_from: tuple[int, int] | None
    arrays: int
    records: int
    checkpoint_bytes: int
    chunks: int
    smallest_chunk_bytes: int
    files: int
    directories: int
    data_files: int
    packs: int
    documents: int
    sharded_arrays: int
    packed_arrays: int
    s3_objects: int
    s3_data_objects: int
    s3_documents: int
    most_files: int
    target_files: int
    save_plan_gather_wire: int
    save_plan_scatter_wire: int
    straddle_bytes: int
    commit_gather_wire: int
    load_plan_gather_wire: int
    load_plan_scatter_wire: int
    load_exchange_bytes: int
    chunk_reads: int
    load_fetched_bytes: int
    load_needed_bytes: int
    coordinator_save_s: float
    coordinator_commit_s: float
    rank_save_s: float
    coordinator_load_s: float
    rank_load_s: float
    record_bytes: int = 0
    record_parse_s: float = 0.0
    extrapolation_check: str = ""
    layouts: dict[str, str] = field(default_factory=dict)
    door_files: dict[str, int] = field(default_factory=dict)
    s3_save: dict[str, int] = field(default_factory=dict)
    s3_load: dict[str, int] = field(default_factory=dict)


def _timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.process_time()
    result = fn()
    return result, time.process_time() - start


@dataclass(frozen=True)
class SaveStage:
    """The plan stage of a save, and its commit: what the coordinator did and sent."""

    plans: list[RankSavePlan]
    gather_wire: int
    scatter_wire: int
    coordinator_s: float
    rank_unpickle_s: float


def save_stage(gathered: list[tuple[list[ShardRecord], list]], probe: int, storage: StorageLayout) -> SaveStage:
    """The coordinator checks and plans (``check_layout``, the strategy's ``plan_save``
    with the chosen ``storage``) and pickles every rank's part; rank ``probe`` unpickles
    its own."""
    world = len(gathered)
    gather_wire = world * max(_framed((PLACE, g, None)) for g in gathered)  # every rank sends the largest's size

    def coordinator() -> tuple[list[RankSavePlan], list[bytes]]:
        layout = GatheredShards.from_gathered(gathered)
        check_layout(layout, where=PLACE)
        plans = plan_with(layout, storage)
        return plans, [pickle.dumps((p, []), protocol=pickle.HIGHEST_PROTOCOL) for p in plans]

    (plans, parts), coordinator_s = _timed(coordinator)
    _, unpickle_s = _timed(lambda: pickle.loads(parts[probe]))
    return SaveStage(plans, gather_wire, world * (max(map(len, parts)) + FRAME), coordinator_s, unpickle_s)


def commit_stage(plans: list[RankSavePlan]) -> tuple[CommitRecord, int, float]:
    """Every rank's chunk reports, gathered; the coordinator binds them into the commit
    record (``bind_chunks``, then what ``commit_save`` adds). Returns the record, the
    bytes of the gather on the wire and the coordinator's CPU seconds."""
    commit = plans[0].commit
    assert commit is not None
    rng = random.Random(0)
    reports = [written_chunks(p, commit.arrays, rng) for p in plans]
    wire = len(plans) * max(_framed(r) for r in reports)
    bound, bind_s = _timed(lambda: bind_chunks(commit, reports, PLACE))
    assert isinstance(bound, CommitRecord)
    files = {CONFIG_FNAME: "crc32c:00c0ffee", COMMON_FILE: "crc32c:0badcafe"}
    return replace(bound, files=files, save_id="simulated"), wire, bind_s


@dataclass(frozen=True)
class LoadStage:
    """The plan stage of a load at the save's layout, and the reads and exchanges planned."""

    scatter_wire: int
    coordinator_s: float
    rank_unpickle_s: float
    exchange_bytes: int
    chunk_reads: int
    fetched_bytes: int
    needed_bytes: int


def load_stage(gathered: list[tuple[list[ShardRecord], list]], arrays: dict[str, ArrayRecord], probe: int) -> LoadStage:
    """The coordinator plans the reads (``plan_load``, ``plan_reads``, fully parallel)
    and pickles every rank's part; rank ``probe`` unpickles its own."""

    # each chunk (a shard) read by one rank for all that ask, as the default load strategy
    # does from ``reads_shards_once``'s world size on
    once = ZarrLoadShardedStrategy().reads_shards_once(len(gathered))
    shards = {key: array.chunk_shape for key, array in arrays.items()} if once else None

    def coordinator() -> list[bytes]:
        parts = plan_load(GatheredShards.from_gathered(gathered), set(), StrictHandling.ASSUME_OK_UNEXPECTED, True,
                          lambda layout: plan_reads(layout, fully_parallel=True, shards=shards))
        return [pickle.dumps((p, []), protocol=pickle.HIGHEST_PROTOCOL) for p in parts]

    parts, coordinator_s = _timed(coordinator)
    _, unpickle_s = _timed(lambda: pickle.loads(parts[probe]))
    plans = [pickle.loads(p)[0] for p in parts]
    by_rank = [g[0] for g in gathered]
    exchange = sum(_read_record(by_rank[p.rank], p.reads, i).nbytes for p in plans for _, ix in p.reads.sends for i in ix)
    return LoadStage(len(parts) * (max(map(len, parts)) + FRAME), coordinator_s, unpickle_s, exchange,
                     *_chunk_reads(by_rank, arrays, plans))


def plan_layout(model: Model, layout: StorageLayout | None = None) -> tuple[Figures, CommitRecord]:
    """Plans a save and a load of ``model`` at its full size with the layout
    ``shardstore.save`` chooses on a file system (``layout``: the caller's; default
    none, shardstore chooses every field), and counts the files every door's chosen
    layout writes there and on S3; returns the figures and the commit record the save
    binds (every chunk's checksums)."""
    world, probe = model.world, model.world // 2
    _fsdp_block.cache_clear()  # the probe rank computes its own blocks, as a real one does
    own, records_s = _timed(lambda: model.rank_records(probe))
    _, pickle_s = _timed(lambda: _framed((PLACE, (own, []), None)))
    gathered = [(model.rank_records(r) if r != probe else own, []) for r in range(world)]
    local = chosen_layout(world, object_store=False, layout=layout)
    save = save_stage(gathered, probe, local)
    nbytes, straddle = save.plans[0].checkpoint_nbytes, _straddle_bytes(save.plans, save.plans[0].commit.arrays)
    doors = files_by_door(lambda: GatheredShards.from_gathered(gathered), world, save.plans, local, layout)
    record, commit_wire, bind_s = commit_stage(save.plans)
    del save.plans[:]  # the plans are done with: their memory is the next stage's
    gc.collect()
    arrays = record.arrays
    load = load_stage(gathered, arrays, probe)
    chunk_sizes = (a.chunk_nbytes(tuple(g - 1 for g in a.chunk_grid)) for a in arrays.values() if a.chunk_count)
    first = DOORS[0].name
    files: LayoutFiles = doors[f"{first}, local"]
    on_s3: LayoutFiles = doors[f"{first}, S3"]
    figures = Figures(
        layout=model.name, ranks=world, layers=model.layers, extrapolated_from=None, arrays=len(arrays),
        records=sum(len(g[0]) for g in gathered), checkpoint_bytes=nbytes,
        chunks=sum(a.chunk_count for a in arrays.values()), smallest_chunk_bytes=min(chunk_sizes, default=0),
        files=files.total, directories=files.directories, data_files=files.data_files, packs=files.packs,
        documents=files.documents, sharded_arrays=files.sharded_arrays, packed_arrays=files.packed_arrays,
        s3_objects=on_s3.total, s3_data_objects=on_s3.data_files + on_s3.packs, s3_documents=on_s3.documents,
        most_files=max(f.total for f in doors.values()),
        target_files=bound(nbytes, len(arrays), world, local.shard_bytes),  # type: ignore[arg-type]
        save_plan_gather_wire=save.gather_wire, save_plan_scatter_wire=save.scatter_wire, straddle_bytes=straddle,
        commit_gather_wire=commit_wire, load_plan_gather_wire=save.gather_wire,
        load_plan_scatter_wire=load.scatter_wire, load_exchange_bytes=load.exchange_bytes,
        chunk_reads=load.chunk_reads, load_fetched_bytes=load.fetched_bytes, load_needed_bytes=load.needed_bytes,
        coordinator_save_s=save.coordinator_s, coordinator_commit_s=bind_s,
        rank_save_s=records_s + pickle_s + save.rank_unpickle_s, coordinator_load_s=load.coordinator_s,
        rank_load_s=records_s + pickle_s + load.rank_unpickle_s,
        layouts={where: f.layout for where, f in doors.items()},
        door_files={where: f.total for where, f in doors.items()},
    )
    return figures, record


LAYER_KEY = re.compile(r"\.layers\.(\d+)\.")


def full_size_record(sample: CommitRecord, sample_layers: int, layers: int, world: int) -> CommitRecord | None:
    """The record of ``layers`` layers made from a record planned at ``sample_layers``:
    layer ``i``'s arrays are layer ``i % sample_layers``'s under its own key. None when
    the keys do not name their layer (layer-stacked arrays change shape instead)."""
    fixed = {k: a for k, a in sample.arrays.items() if not LAYER_KEY.search(k)}
    if len(fixed) == len(sample.arrays):
        return None
    arrays = dict(fixed)
    for key in sample.arrays:
        match = LAYER_KEY.search(key)
        if match is None or int(match.group(1)) != 0:
            continue
        for layer in range(layers):
            source = key if sample_layers == 1 else LAYER_KEY.sub(f".layers.{layer % sample_layers}.", key, count=1)
            new_key = LAYER_KEY.sub(f".layers.{layer}.", key, count=1)
            arrays[new_key] = replace(sample.arrays[source], key=new_key)
    return replace(sample, arrays=arrays, world_size=world, save_id="simulated")


def measure_record(record: CommitRecord) -> tuple[int, float]:
    """Bytes of the root ``zarr.json`` as written, and the CPU seconds of one parse."""
    data = record.to_json()
    _, parse_s = _timed(lambda: CommitRecord.from_json(data, PLACE))
    return len(data), parse_s


def _extrapolate(low: Figures, high: Figures, layers: int) -> Figures:
    """Every number of the figures, linear in the layer count through two samples."""
    scale = (layers - low.layers) / (high.layers - low.layers)
    values = {}
    for name, a in asdict(low).items():
        b = getattr(high, name)
        if isinstance(a, dict) and all(isinstance(v, int) for v in a.values()):
            values[name] = {k: round(v + (b[k] - v) * scale) for k, v in a.items()}
        elif isinstance(a, bool) or not isinstance(a, (int, float)) or name in ("ranks", "layers"):
            values[name] = a
        else:
            value = a + (b - a) * scale
            values[name] = round(value) if isinstance(a, int) else value
    values.update(layers=layers, extrapolated_from=(low.layers, high.layers))
    values.update(most_files=max(values["door_files"].values()))
    return Figures(**values)


def measure_records(figures: Figures, record: CommitRecord) -> None:
    """The commit record's bytes and parse time."""
    figures.record_bytes, figures.record_parse_s = gc_paused(measure_record)(record)


def simulate_whole(model: Model, layout: StorageLayout | None = None) -> Figures:
    """The figures of ``model`` planned at its full size (``layout``: ``plan_layout``'s)."""
    figures, record = gc_paused(plan_layout)(model, layout)
    measure_records(figures, record)
    return figures


def simulate_sampled(model: Model, layout: StorageLayout | None = None) -> Figures:
    """The figures of ``model`` extrapolated from two reduced layer counts; its commit
    record built at full size where the keys name their layer, else its size and
    parse time extrapolated as well."""
    a, b = model.sample_layers()
    low, low_record = gc_paused(plan_layout)(model.with_layers(a), layout)
    high, high_record = gc_paused(plan_layout)(model.with_layers(b), layout)
    record = full_size_record(low_record, a, model.layers, model.world)
    if record is None:
        measure_records(low, low_record)
        measure_records(high, high_record)
    del low_record, high_record
    gc.collect()
    figures = _extrapolate(low, high, model.layers)
    # a rank's CPU is too small to extrapolate through two noisy samples (it can come
    # out negative): scaled from the larger sample by the rank's own records instead
    scale = len(model.rank_records(model.world // 2)) / len(model.with_layers(b).rank_records(model.world // 2))
    figures.rank_save_s, figures.rank_load_s = high.rank_save_s * scale, high.rank_load_s * scale
    if record is not None:
        measure_records(figures, record)
    return figures


CHECKED = ("files", "save_plan_gather_wire", "commit_gather_wire", "record_bytes", "coordinator_save_s",
           "coordinator_commit_s", "coordinator_load_s", "rank_save_s", "record_parse_s")


def extrapolation_check(whole: Figures, sampled: Figures) -> str:
    """Sampled / whole, for the figures ``CHECKED``."""
    ratios = (f"{name} {getattr(sampled, name) / getattr(whole, name):.2f}" for name in CHECKED if getattr(whole, name))
    return f"extrapolated from {sampled.extrapolated_from} / planned whole: " + ", ".join(ratios)


def simulate(model: Model, max_records: int, s3: S3Costs | None, check: bool = False,
             layout: StorageLayout | None = None) -> Figures:
    """The figures of ``model``: planned whole, or (above ``max_records`` shard records)
    extrapolated; ``check``: a layout planned whole is also extrapolated, and the
    ratios kept in ``extrapolation_check``; ``layout``: the caller's (default none:
    shardstore chooses). S3 requests of a save: the fit's per object written (data
    files and packs), per document, per rank and per save, at the S3 layout."""
    whole = len(model.rank_records(model.world // 2)) * model.world <= max_records
    figures = simulate_whole(model, layout) if whole else simulate_sampled(model, layout)
    gc.collect()
    if whole and check:
        figures.extrapolation_check = extrapolation_check(figures, simulate_sampled(model, layout))
        gc.collect()
    if s3 is not None:
        figures.s3_save = s3.requests("save", figures.s3_data_objects, figures.s3_documents, figures.ranks)
        figures.s3_load = s3.requests("load", figures.chunk_reads, figures.arrays, figures.ranks)
    return figures


# --- report --------------------------------------------------------------------------


def _n(value: float) -> str:
    return f"{value:,.0f}"


def _bytes(value: float) -> str:
    """``value`` bytes in MB, or GB from 10 GB."""
    return f"{value / 1e9:,.0f} GB" if value >= 1e10 else f"{value / 1e6:,.1f} MB"


def _within(value: int, most: int) -> str:
    return f"<= {_n(most)}: {'yes' if value <= most else 'NO'} (x{value / most:,.2f})"


def report_rows(f: Figures, target_parse_s: float) -> list[tuple[str, str, str]]:
    """``(what, default layout, bound)`` rows of one layout."""
    requests = lambda counts: ", ".join(f"{m} {_n(c)}" for m, c in counts.items() if c) or "not measured"  # noqa: E731
    saved = sum(f.s3_save.values())
    return [
        ("arrays / shard records", f"{_n(f.arrays)} / {_n(f.records)}", ""),
        ("checkpoint bytes", f"{f.checkpoint_bytes / 1e9:,.1f} GB", ""),
        ("arrays sharded / packed", f"{_n(f.sharded_arrays)} / {_n(f.packed_arrays)}", ""),
        ("chunks and shards (smallest)", f"{_n(f.chunks)} ({_n(f.smallest_chunk_bytes)} B)", ""),
        ("files, local: data + packs + documents + 3", f"{_n(f.data_files)} + {_n(f.packs)} + {_n(f.documents)} + 3",
         ""),
        ("files, local", _n(f.files), _within(f.files, f.target_files)),
        ("directories (local disk)", _n(f.directories), ""),
        ("S3 objects per save", _n(f.s3_objects), _within(f.s3_objects, f.target_files)),
        ("most files or objects of any door", _n(f.most_files), _within(f.most_files, f.target_files)),
        ("S3 requests per save (fitted)", requests(f.s3_save), _within(saved, f.target_files) if saved else ""),
        ("S3 requests per load (same layout; a shard fitted as a chunk)", requests(f.s3_load), ""),
        ("save: plan gather / scatter, on the wire", f"{_bytes(f.save_plan_gather_wire)} / {_bytes(f.save_plan_scatter_wire)}",
         ""),
        ("save: pieces exchanged (straddling, shards, packs)", _bytes(f.straddle_bytes), ""),
        ("save: commit gather (chunk reports)", _bytes(f.commit_gather_wire), ""),
        ("load: plan gather / scatter", f"{_bytes(f.load_plan_gather_wire)} / {_bytes(f.load_plan_scatter_wire)}", ""),
        ("load: replicated blocks exchanged", _bytes(f.load_exchange_bytes), ""),
        ("load: bytes fetched / bytes asked for", f"{_bytes(f.load_fetched_bytes)} / {_bytes(f.load_needed_bytes)}",
         f"<= x1.25, item 4 (x{f.load_fetched_bytes / max(1, f.load_needed_bytes):.2f})"),
        ("save CPU s: coordinator plan / commit bind", f"{f.coordinator_save_s:.2f} / {f.coordinator_commit_s:.2f}", ""),
        ("save CPU s: per rank", f"{f.rank_save_s:.3f}", ""),
        ("load CPU s: coordinator plan / per rank (no parse)", f"{f.coordinator_load_s:.2f} / {f.rank_load_s:.3f}", ""),
        ("commit record", _bytes(f.record_bytes), ""),
        ("record parse s, every rank", f"{f.record_parse_s:.2f}",
         f"< {target_parse_s:g} (x{f.record_parse_s / target_parse_s:.1f})"),
        ("record bytes all ranks read", _bytes(f.record_bytes * f.ranks), ""),
    ]


def print_report(figures: list[Figures], s3: S3Costs | None) -> None:
    for f in figures:
        how = (f"extrapolated linearly from {f.extrapolated_from[0]} and {f.extrapolated_from[1]} layers"
               if f.extrapolated_from else "planned whole")
        print(f"\n### {f.layout}, {f.ranks:,} ranks ({f.layers} layers; {how})\n")
        print("| door, store | layout chosen | files (objects) |\n|---|---|---:|")
        for where, chosen in f.layouts.items():
            print(f"| {where} | {chosen} | {_n(f.door_files[where])} |")
        print("\n| | default layout | bound: bytes / shard + 2 x arrays + ranks |\n|---|---:|---:|")
        for what, value, target in report_rows(f, 1.0):
            print(f"| {what} | {value} | {target} |")
        if f.extrapolation_check:
            print(f"\nCheck of the extrapolation: {f.extrapolation_check}")
    notes = [door for door in DOORS if door.note]
    for door in notes:
        print(f"\n{door.name}: {door.note}.")
    if s3 is not None:
        print(f"\nS3 requests fitted per ({', '.join(S3_TERMS)}):")
        for op in ("save", "load"):
            print(f"  {op}: " + "; ".join(f"{m} {c}" for m, c in getattr(s3, op).items() if any(c)))
        print(f"  {s3.check}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small worlds, in seconds (no S3 calibration)")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 request calibration")
    parser.add_argument("--max-records", type=int, default=2_000_000,
                        help="above this many shard records a layout is sampled and extrapolated")
    parser.add_argument("--check-extrapolation", action="store_true",
                        help="also extrapolate the layouts planned whole, and compare")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--per-array", action="store_true",
                        help="plan with the per-array layout (each block a chunk file) instead of the chosen one")
    args = parser.parse_args()
    s3 = None
    if not (args.quick or args.no_s3):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            s3 = calibrate_s3(Path(tmp))
        print("S3 calibrated", file=sys.stderr, flush=True)
    figures = []
    for model in layouts(args.quick):
        start = time.monotonic()
        figures.append(simulate(model, args.max_records, s3, args.check_extrapolation,
                                StorageLayout(shard_bytes=None, pack_arrays_up_to=0, zarr_metadata="per_node")
                                if args.per_array else None))
        print(f"{model.name} at {model.world} ranks: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    print_report(figures, s3)
    if args.json:
        args.json.write_text(json.dumps([asdict(f) for f in figures], indent=1))


if __name__ == "__main__":
    main()
