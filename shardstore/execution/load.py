"""A rank's part of a load, as its ``planning.plans.RankReadPlan`` says: read, agree, exchange.

Each rank reads its regions (only the chunks that overlap them, all reads in flight at
once, each chunk checked against its own crc32c and the one the commit record binds),
then every rank agrees that the reads succeeded, then the blocks that several ranks
asked for, or that the reader of their shard read for them, travel from the rank that
read them (``run_read_plan``). On a local disk
chunks go straight into the result's memory (``shardstore.format.chunks``); a request's own
contiguous tensor of the stored dtype and shape is filled in place, on the CPU directly
and on a GPU through pinned slabs (``staging.DeviceUploader``).
"""

from __future__ import annotations

__all__ = ["ReadOp", "flat_boxes", "forwarded_request", "load_tensors", "plan_read", "run_read_plan"]

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shardstore.errors import CheckpointingException, first_failure
from shardstore.execution.loaded import local_part, place_loaded, postprocess_loaded, result_device
from shardstore.execution.staging import DeviceUploader
from shardstore.format.chunks import (
    DEFAULT_IO_CONCURRENCY,
    ArrayChunks,
    ReadJob,
    chunk_pieces,
    chunk_store_for,
    read_region,
    run_reads,
)
from shardstore.format.dtypes import (
    from_zarr_name,
    holds_its_values,
    numpy_to_tensor,
    tensor_to_numpy,
)
from shardstore.format.records import ArrayRecord, CommitRecord
from shardstore.mapping import ShardedTensor
from shardstore.planning.layout import Region, ShardRecord, block_shape, region_at, region_shape
from shardstore.planning.plans import RankReadPlan
from shardstore.protocol.collectives import Group
from shardstore.protocol.stage import Transfers, run_stage
from shardstore.stores.base import Location


@dataclass
class ReadOp:
    """A region to read for one ShardedTensor and how to turn it into its tensor."""

    tensor: ShardedTensor
    region: Region
    finish: Callable[[torch.Tensor], torch.Tensor]
    # A flattened range of an array whose codec reads parts of a chunk (shards): the
    # range as boxes of its block, each with its offset in the range, read instead of
    # ``region`` (the whole rows it touches), so only the inner chunks it covers are read.
    boxes: tuple[tuple[Region, int], ...] = ()


def plan_read(t: ShardedTensor, record: ArrayRecord, where: str) -> ReadOp:
    """Which region of the stored array ``t`` needs, and the post-processing after it.

    A flattened range reads only the rows of its block that it touches, or, from a
    sharded array, only the parts of them it covers (``flat_boxes``).
    """
    if record.shape != t.global_shape and not t.allow_shape_mismatch:
        raise CheckpointingException(
            f"{where}: tensor {t.key!r} is stored with global shape {record.shape}, the state "
            f"dict expects {t.global_shape}; set allow_shape_mismatch=True to load it padded or truncated"
        )
    if len(record.shape) != len(t.global_shape):
        raise CheckpointingException(
            f"{where}: tensor {t.key!r} is stored with {len(record.shape)} dims, expected {len(t.global_shape)}"
        )
    extent = block_shape(t)
    block = region_at(t.global_offset, extent)
    fr = t.flattened_range
    if fr is not None and record.shape == t.global_shape and len(extent) > 0:
        axis = next((a for a, b in enumerate(extent) if b > 1), len(extent) - 1)
        row = math.prod(extent[axis + 1 :])
        first, last = fr.start // row, -(-fr.stop // row)
        region = block[:axis] + (slice(block[axis].start + first, block[axis].start + last),) + block[axis + 1 :]
        skip = fr.start - first * row

        if record.codec.reads_spans:  # the range's elements, flat (an empty range: none, not its region's box)
            return ReadOp(t, region, lambda x: x.reshape(-1)[: fr.stop - fr.start], flat_boxes(block, fr.start, fr.stop))

        def finish_flat(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1)[skip : skip + fr.stop - fr.start]

        return ReadOp(t, region, finish_flat)
    region = tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(block, record.shape))

    def finish(x: torch.Tensor) -> torch.Tensor:
        return postprocess_loaded(x.reshape(local_part(region, t.prepend_axis_num)), t)

    return ReadOp(t, region, finish)


def flat_boxes(box: Region, start: int, stop: int, at: int = 0) -> tuple[tuple[Region, int], ...]:
    """The elements ``[start, stop)`` of ``box`` in C order as boxes, each with the
    offset of its first element in the range (plus ``at``): a partial slab along the
    first axis, the whole slabs between, a partial one after (at most ``2 * ndim - 1``)."""
    if start >= stop:
        return ()
    if not box:
        return (((), at),)
    first, rest = box[0], box[1:]
    slab = math.prod(s.stop - s.start for s in rest)
    lo, hi = divmod(start, slab), divmod(stop, slab)
    if lo[0] == hi[0]:
        row = slice(first.start + lo[0], first.start + lo[0] + 1)
        return tuple(((row, *r), o) for r, o in flat_boxes(rest, lo[1], stop - lo[0] * slab, at))
    out: list[tuple[Region, int]] = []
    whole = lo[0]
    if lo[1]:
        row = slice(first.start + lo[0], first.start + lo[0] + 1)
        out += [((row, *r), o) for r, o in flat_boxes(rest, lo[1], slab, at)]
        whole += 1
    if whole < hi[0]:
        out.append(((slice(first.start + whole, first.start + hi[0]), *rest), at + whole * slab - start))
    if hi[1]:
        row = slice(first.start + hi[0], first.start + hi[0] + 1)
        out += [((row, *r), o) for r, o in flat_boxes(rest, 0, hi[1], at + hi[0] * slab - start)]
    return tuple(out)


def load_tensors(
    tensors: list[ShardedTensor], location: Location, record: CommitRecord,
    io_concurrency: int = DEFAULT_IO_CONCURRENCY, allow_lossy_casts: bool = False,
    uploader: DeviceUploader | None = None,
) -> list[torch.Tensor]:
    """Reads every tensor's region, all reads in flight at once; returns them in order.

    Chunks land straight in the result's memory where they can (``chunk_io``); each
    is checked against its own crc32c and the one the commit record binds. A request
    whose ``data`` is a contiguous tensor of the stored dtype and the region's shape
    is filled in place and returned (as DCP loads): no second copy of the rank's state.
    On the CPU the chunks are read into it; on a device they go through ``uploader``'s
    pinned slabs, copied to the device while the next wave is read. On a failed load
    such a tensor may hold part of the checkpoint.
    """
    where = f"checkpoint {location.describe()}"
    missing = sorted({t.key for t in tensors if t.key not in record.arrays})
    if objects := [key for key in missing if key in record.object_keys]:
        raise CheckpointingException(
            f"{where} holds {objects} as ShardedObject(s), not tensors: ask for them with a ShardedObject "
            "of the same key"
        )
    if missing:
        raise CheckpointingException(
            f"{where} has no tensor(s) {missing}; pass strict='log_unexpected' (or another "
            "StrictHandling) to skip keys that are not in the checkpoint"
        )
    reads = [plan_read(t, record.arrays[t.key], where) for t in tensors]
    store = chunk_store_for(location, io_concurrency)
    arrays: list[np.ndarray | None] = []  # None: filled in place (the request's tensor is the result)
    jobs: list[ReadJob] = []
    uploads: list[int] = []  # reads into device targets
    targets_seen: set[int] = set()  # tied tensors (one memory, two keys) get their own results
    for n, r in enumerate(reads):
        stored = record.arrays[r.tensor.key]
        dtype = from_zarr_name(stored.dtype)
        if r.boxes:  # a flattened range: its parts, each into its run of the result
            out = np.empty(r.tensor.flattened_range.stop - r.tensor.flattened_range.start, dtype.numpy_dtype)
            arrays.append(out)
            chunks = ArrayChunks.of(store, stored)
            for box, at in r.boxes:
                box_shape = region_shape(box)
                jobs += read_region(chunks, box, out[at : at + math.prod(box_shape)].reshape(box_shape))
            continue
        shape = region_shape(r.region)
        target = _in_place_target(r, dtype.torch_dtype, targets_seen)
        if target is None:
            out = np.empty(shape, dtype.numpy_dtype)
            arrays.append(out)
        else:
            arrays.append(None)
            if _through_host(target):
                uploads.append(n)
                continue
            out = tensor_to_numpy(target).reshape(shape)
        jobs += read_region(ArrayChunks.of(store, stored), r.region, out)
    uploader = uploader or DeviceUploader()
    beside = _beside_host_reads(reads, record, uploads, uploader.max_bytes)
    for n, out in beside.items():
        r = reads[n]
        jobs += read_region(ArrayChunks.of(store, record.arrays[r.tensor.key]), r.region, out)
    uploads = [n for n in uploads if n not in beside]
    run_reads(jobs, store.threads)
    for n in list(beside):  # copied over from host memory (the chunk is read once), then let go
        target = reads[n].tensor.data.detach()
        target.copy_(numpy_to_tensor(beside.pop(n), target.dtype).reshape(target.shape))

    def read_wave(pairs: list[tuple[int, torch.Tensor]]) -> None:
        wave_jobs: list[ReadJob] = []
        for i, host in pairs:
            r = reads[uploads[i]]
            out = tensor_to_numpy(host).reshape(region_shape(r.region))
            wave_jobs += read_region(ArrayChunks.of(store, record.arrays[r.tensor.key]), r.region, out)
        run_reads(wave_jobs, store.threads)

    uploader.fill([reads[n].tensor.data for n in uploads], read_wave)
    results = []
    for r, array in zip(reads, arrays):
        if array is None:
            results.append(r.tensor.data)
            continue
        stored = record.arrays[r.tensor.key]
        x = numpy_to_tensor(array, from_zarr_name(stored.dtype).torch_dtype)
        results.append(place_loaded(r.finish(x), r.tensor, where, allow_lossy_casts))
    return results


def _beside_host_reads(
    reads: list[ReadOp], record: CommitRecord, uploads: list[int], max_bytes: int,
) -> dict[int, np.ndarray]:
    """Of the reads into device tensors (``uploads``), those that touch a chunk a read
    into host memory touches too (a chunk's reader's own block, beside the blocks it
    reads for other ranks), each with the host array it is read into instead: with the
    host reads, so the chunk is read once (``format.chunks`` reads a chunk once for all
    its regions in one batch), then copied to the device, rather than read again
    through the staging waves. At most ``max_bytes`` of them (the staging bound, which
    these arrays stand in for); past that, a read goes through the waves, its chunk
    read again."""
    if not uploads:
        return {}
    waved = set(uploads)
    on_host = set().union(*(_chunks_of(r, record) for n, r in enumerate(reads) if n not in waved))
    beside: dict[int, np.ndarray] = {}
    held = 0
    for n in uploads if on_host else ():
        r = reads[n]
        nbytes = r.tensor.data.nbytes
        if held + nbytes <= max_bytes and _chunks_of(r, record) & on_host:
            beside[n] = np.empty(region_shape(r.region), from_zarr_name(record.arrays[r.tensor.key].dtype).numpy_dtype)
            held += nbytes
    return beside


def _chunks_of(read: ReadOp, record: CommitRecord) -> set[tuple[str, tuple[int, ...]]]:
    """The chunks (of a sharded array: the shards) a read touches."""
    array = record.arrays[read.tensor.key]
    regions = [box for box, _ in read.boxes] if read.boxes else [read.region]
    return {(read.tensor.key, piece.index) for region in regions
            for piece in chunk_pieces(region, array.shape, array.chunk_shape)}


def _through_host(target: torch.Tensor) -> bool:
    """Whether chunks reach ``target`` through host staging (device memory) rather
    than being read into it."""
    return target.device.type != "cpu"


def _claim(data: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...], taken: set[int]) -> bool:
    """Whether a request's ``data`` can be filled in place with a result of ``dtype``
    and ``shape``: a CPU or CUDA tensor (other devices get the result moved to them,
    meta ones a CPU result: ``result_device``) of exactly that dtype and shape, whose memory holds its values
    (``holds_its_values``: contiguous, no conjugate or negative view) and no other request
    of this load took (``taken``: data pointers; updated when claimed). Tied tensors
    (one memory, two keys) so get their own results."""
    if (
        data is None or data.device.type not in ("cpu", "cuda") or data.dtype != dtype
        or not holds_its_values(data) or tuple(data.shape) != shape or data.data_ptr() in taken
    ):
        return False
    taken.add(data.data_ptr())
    return True


def _in_place_target(read: ReadOp, stored_dtype: torch.dtype, taken: set[int]) -> torch.Tensor | None:
    """The request's own tensor as the destination of its region, when the read needs
    no conversion (no flattened range, padding or prepended-axis change) and ``_claim``
    gives it."""
    t = read.tensor
    shape = local_part(read.region, t.prepend_axis_num)
    if t.flattened_range is not None or not _claim(t.data, stored_dtype, shape, taken):
        return None
    return t.data.detach()


def run_read_plan(
    tensors: list[ShardedTensor], location: Location, record: CommitRecord, plan: RankReadPlan, group: Group,
    io_concurrency: int = DEFAULT_IO_CONCURRENCY, allow_lossy_casts: bool = False,
    local_error: BaseException | None = None, uploader: DeviceUploader | None = None,
) -> list[torch.Tensor]:
    """Collective (one stage, ``protocol.stage.run_stage``): this rank's part of a load
    (``planning.plans.plan_reads``): its reads, agreed by every rank (a failed read, or
    ``local_error``, raises on every rank before any exchange), then the exchange of
    blocks that other ranks read for it and it read for them (``plan.forwards`` among
    them: new host memory, let go when this returns)."""

    requested = len(tensors)
    pieces = _Pieces(tensors, ())
    try:  # indices past its own: its pieces, then blocks it reads for others (out of memory here fails every rank)
        if (plan.forwards or plan.pieces) and plan.requested != requested + len(plan.pieces):
            raise CheckpointingException(
                f"Loading checkpoint {location.describe()}: the read plan was made for "
                f"{plan.requested - len(plan.pieces)} requested tensors on rank {plan.rank}, which passes {requested}; "
                "a strategy or wrapper must hand run_read_plan the tensors it planned"
            )
        pieces = _Pieces(tensors, plan.pieces)
        tensors = [*tensors, *pieces.requests, *(forwarded_request(s, record) for s in plan.forwards)]
    except Exception as exc:  # raised on every rank by the stage
        local_error = first_failure(local_error, exc)

    def read() -> dict[int, torch.Tensor]:
        loaded = load_tensors(
            [tensors[i] for i in plan.reads], location, record, io_concurrency, allow_lossy_casts, uploader
        )
        return dict(zip(plan.reads, loaded))

    out: dict[int, torch.Tensor] = run_stage(
        group, f"Reading checkpoint {location.describe()}", read,
        transfers=lambda read_out: replica_transfers(tensors, plan, read_out), local_error=local_error,
    )
    out.update(pieces.assembled(out, requested))
    return [out[i] for i in range(requested)]


class _Pieces:
    """A rank's requests split at chunk edges (``RankReadPlan.pieces``): a request for
    each piece, landing in its part of the tensor the split request returns (the
    request's own where a load may fill it in place, ``_claim``; a new one otherwise),
    and that tensor once every piece is in. The pieces of a block's leading axis, and
    of a flattened range, are contiguous runs of it, so each lands in place. A failure
    copying one in (after the read stage's agreement) is raised on its rank alone: only
    a new tensor's memory is written there."""

    def __init__(self, tensors: list[ShardedTensor], pieces: Sequence[tuple[int, tuple[tuple[int, int], ...]]]) -> None:
        # tied requests (one memory, two keys): a split one gets a new tensor (unsplit, the first fills it)
        held = Counter(t.data.data_ptr() for t in tensors if t.data is not None) if pieces else Counter()
        shared = {ptr for ptr, n in held.items() if n > 1}
        self.targets: dict[int, torch.Tensor] = {}
        self.parts: list[tuple[int, tuple[slice, ...]]] = []
        self.requests: list[ShardedTensor] = []
        for index, box in pieces:
            t = tensors[index]
            if index not in self.targets:  # the request's own tensor, as a load returns it unsplit
                self.targets[index] = _receive_target(t, shared)
            at, request = _piece(t, box, self.targets[index].detach())  # detached: it may be a parameter
            self.requests.append(request)
            self.parts.append((index, at))

    def assembled(self, out: dict[int, torch.Tensor], first: int) -> dict[int, torch.Tensor]:
        """Each split request's tensor, its pieces (``out[first + k]``) copied in where
        they did not land in it."""
        for k, (index, at) in enumerate(self.parts):
            part, got = self.targets[index].detach()[at], out[first + k]
            if not (got.data_ptr() == part.data_ptr() and got.shape == part.shape and got.stride() == part.stride()):
                part.copy_(got.reshape(part.shape))
        return self.targets


def _piece(
    t: ShardedTensor, box: tuple[tuple[int, int], ...], target: torch.Tensor,
) -> tuple[tuple[slice, ...], ShardedTensor]:
    """Where the part ``box`` of request ``t`` lies in ``target`` (the tensor a load
    returns for ``t``), and the request for it, landing there: of a block, a block; of
    a flattened range, the range's part of the same block."""
    if t.flattened_range is not None:
        ((a, b),) = box
        at: tuple[slice, ...] = (slice(a, b),)
        start = t.flattened_range.start
        return at, ShardedTensor(t.key, target[at], t.dtype, t.local_shape, t.global_shape, t.global_offset, None,
                                 t.replica_id, t.prepend_axis_num, flattened_range=slice(start + a, start + b))
    at = tuple(slice(a, b) for a, b in box[t.prepend_axis_num :])
    part = target[at]
    offset = tuple(o + a for o, (a, _) in zip(t.global_offset, box))
    return at, ShardedTensor(t.key, part, t.dtype, tuple(part.shape), t.global_shape, offset, None, t.replica_id,
                             t.prepend_axis_num)


def forwarded_request(s: ShardRecord, record: CommitRecord) -> ShardedTensor:
    """A request like another rank's ``s`` (``RankReadPlan.forwards``): its block with no
    prepended axes (the same elements, which travel as bytes). Where the read can land
    in place (the whole block, stored in its dtype and global shape) it is given new
    host memory to land in; otherwise none (``data`` None): the read makes its result,
    and no buffer is held beside it."""
    dtype = from_zarr_name(s.dtype).torch_dtype
    flat = None if s.flat_range is None else slice(*s.flat_range)
    stored = record.arrays.get(s.key)
    in_place = flat is None and stored is not None and stored.dtype == s.dtype and stored.shape == s.global_shape
    data = torch.empty(s.block_shape, dtype=dtype) if in_place else None
    return ShardedTensor(s.key, data, dtype, s.block_shape, s.global_shape, s.offset, None,
                         allow_shape_mismatch=s.allow_shape_mismatch, flattened_range=flat)


def replica_transfers(tensors: list[ShardedTensor], plan: RankReadPlan, out: dict[int, torch.Tensor]) -> Transfers:
    """Places the blocks this rank read for two of its requests (``plan.copies``) and
    the targets of those other ranks read for it (added to ``out``, filled by the
    transfers); returns the transfers."""
    taken = {x.data_ptr() for i, x in out.items() if x is tensors[i].data}  # filled in place already
    for index, source in plan.copies:  # one block asked for twice: read once, copied
        out[index] = _receive_target(tensors[index], taken)
        out[index].detach().copy_(out[source].reshape(out[index].shape))  # detached: it may be a parameter
    transfers = Transfers(sends={peer: [out[i] for i in indices] for peer, indices in plan.sends})
    for peer, indices in plan.receives:
        for i in indices:
            out[i] = _receive_target(tensors[i], taken)
        transfers.receives[peer] = [out[i] for i in indices]
    return transfers


def _receive_target(t: ShardedTensor, taken: set[int]) -> torch.Tensor:
    """Where a block read for another request lands for ``t`` (by another rank, or by
    this one for the same block asked for twice): the request's own tensor when
    ``_claim`` gives it, as reads fill it; else a new tensor on its device."""
    shape = _result_shape(t)
    if _claim(t.data, t.dtype, shape, taken):
        return t.data
    return torch.empty(shape, dtype=t.dtype, device=result_device(t))


def _result_shape(t: ShardedTensor) -> tuple[int, ...]:
    """The shape of the tensor a load returns for ``t``."""
    if t.flattened_range is not None:
        return (t.flattened_range.stop - t.flattened_range.start,)
    return tuple(t.local_shape)
