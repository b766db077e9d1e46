"""PyTorch DCP's ``StorageReader`` on shardstore's format: ``dcp.load(state_dict,
storage_reader=ShardstoreReader(path))`` reads a checkpoint ``shardstore.save`` or
``ShardstoreWriter`` wrote (``compat.dcp.writer``), resharded as DCP's planner asks.
"""

from __future__ import annotations

__all__ = ["ShardstoreReader"]

import io
import logging
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from shardstore.compat.dcp.parts import CheckpointId, id_text, new_id
from shardstore.dict_utils import flatten
from shardstore.engine.load import verify_checkpoint_and_load_strategy
from shardstore.engine.zarr_strategies import (
    ZarrLoadShardedStrategy,
)
from shardstore.errors import CheckpointingException
from shardstore.format import (
    DEFAULT_IO_CONCURRENCY,
    ArrayChunks,
    CommitRecord,
    DcpMetadata,
    StatePath,
    cast_checked,
    chunk_store_for,
    from_zarr_name,
    holds_its_values,
    numpy_to_tensor,
    read_region,
    run_reads,
    tensor_to_numpy,
)
from shardstore.inputs.dtensors import fqn
from shardstore.mapping import ShardedTensor
from shardstore.opened import bare_location, open_read
from shardstore.protocol import Group
from shardstore.stores import Location

logger = logging.getLogger(__name__)

@dataclass
class _OpenCheckpoint:
    """What ``read_metadata`` found: the checkpoint, its commit record and its common
    values by fully qualified name."""

    location: Location
    record: CommitRecord
    common: dict[str, Any]

class ShardstoreReader(StorageReader):
    """DCP ``StorageReader`` that reads a shardstore checkpoint: ``dcp.load(state,
    storage_reader=ShardstoreReader(path))``. Every region is read from the chunks it
    touches and checked against their crc32c, straight into the destination tensor
    where it can be; what it does at each of DCP's calls: docs/guide/dcp-fsdp2.md ("What
    the reader does at each call").

    Args:
        checkpoint_id: the checkpoint (local path, ``s3://bucket/prefix`` or a Location);
            DCP's ``checkpoint_id=`` replaces it.
        io_concurrency: chunk reads in flight at once per rank.
        allow_lossy_casts: convert to the requested dtype even where that changes values
            (0.1 into bfloat16, ...), as DCP's own ``FileSystemReader`` does (on by
            default, as there); off, such a load raises, naming the key.
            ``shardstore.load`` refuses such casts unless asked.
        process_group: the ranks that load together: the group given to
            ``dcp.load(process_group=...)`` (default: the world).
        read_shards_once: the ranks plan their reads together and a chunk several
            need is read by one and sent (``"auto"``: from ``AUTO_SHARD_MIN_RANKS``,
            32, ranks); ``False``: each rank reads every chunk its regions touch.
    """

    def __init__(
        self, checkpoint_id: CheckpointId | None = None, *, io_concurrency: int = DEFAULT_IO_CONCURRENCY,
        allow_lossy_casts: bool = True, process_group: dist.ProcessGroup | None = None,
        read_shards_once: bool | Literal["auto"] = "auto",
    ) -> None:
        super().__init__()
        self.checkpoint_id = checkpoint_id
        self.io_concurrency = io_concurrency
        self.allow_lossy_casts = allow_lossy_casts
        self.process_group = process_group
        self.load_id = new_id()
        self._open: _OpenCheckpoint | None = None
        # reads in the stored dtype (``_copy`` converts, as ``allow_lossy_casts`` says)
        self._strategy = ZarrLoadShardedStrategy(io_concurrency, process_group=process_group,
                                                 read_shards_once=read_shards_once)

    def reset(self, checkpoint_id: CheckpointId | None = None) -> None:
        """A new load: its checkpoint id (when given) and a new DCP load id."""
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
        self.load_id = new_id()
        self._open = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """All ranks: the commit record and common.pt as DCP's Metadata. A save through
        ``ShardstoreWriter`` gives DCP's names, planner data and storage ids back, as
        DCP's own writer recorded them (``DcpMetadata``); any other checkpoint, and one
        saved through ``ShardstoreWriter`` before they were recorded, gives its arrays'
        keys and its common values by every name a request may give them
        (``_flat_common``), no planner data, and only this load's id."""
        if self.checkpoint_id is None:
            raise CheckpointingException("ShardstoreReader has no checkpoint path: pass one, or checkpoint_id= to dcp.load")
        opened = open_read(bare_location(self.checkpoint_id))
        location = opened.location
        if not opened.is_shardstore:
            raise CheckpointingException(
                f"{location.describe()} is not a shardstore checkpoint (another tool's format); read it with that "
                "tool's reader (DCP's FileSystemReader), or convert it (`shardstore convert`)"
            )
        record = opened.require_record()
        _, common_strategy = verify_checkpoint_and_load_strategy(opened)
        stored = common_strategy.load_common(location)
        paths = record.dcp.paths if record.dcp is not None else None
        if paths is None:
            common = {
                key: value for key, value in _flat_common(stored).items()
                if not (value is None and key in record.arrays)  # an array's place in a list (``nested_common``)
            }
        else:
            common = _values_at_paths(stored, paths, record, location.describe())
        self._open = _OpenCheckpoint(location, record, common)
        described: dict[str, Any] = {key: _array_metadata(array.shape, array.dtype) for key, array in record.arrays.items()}
        for key, value in common.items():
            if key in described:
                raise CheckpointingException(
                    f"{location.describe()}: {key!r} names both an array and a value of the common state"
                )
            described[key] = (
                _tensor_metadata(tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor)
                else BytesStorageMetadata()
            )
        return Metadata(
            state_dict_metadata=described, planner_data=None if paths is None else dict(paths),
            storage_meta=self._storage_meta(record.dcp), version=CURRENT_DCP_VERSION,
        )

    def _storage_meta(self, recorded: DcpMetadata | None) -> StorageMeta:
        """DCP's ids: the save's as recorded, and this load's (``FileSystemReader``'s)."""
        if recorded is None:
            return StorageMeta(load_id=self.load_id)
        return StorageMeta(recorded.checkpoint_id, recorded.save_id, self.load_id, list(recorded.modules))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: decides for every rank whether the ranks plan their reads
        together (``read_shards_once``) and tells them (``LoadPlan.storage_data``). Where
        this reader's process group is not the size of ``dcp.load``'s, they do not:
        refused under ``read_shards_once=True``, a warning under ``"auto"``."""
        ranks = len(plans)
        together = ranks > 1 and self._strategy.reads_shards_once(ranks)
        if together and (size := Group(self.process_group).world_size) != ranks:
            where = self._open.location.describe() if self._open is not None else id_text(self.checkpoint_id)
            problem = (f"Loading checkpoint {where}: dcp.load runs on {ranks} ranks and ShardstoreReader's process "
                       f"group has {size}; pass the group given to dcp.load as ShardstoreReader(process_group=...)")
            if self._strategy.read_shards_once is True:
                raise CheckpointingException(problem)
            logger.warning("%s to read each chunk once; each rank reads what it needs instead", problem)
            together = False
        return [replace(plan, storage_data=_ReadTogether(together)) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """All ranks: the common values of this rank's plan, then its array regions: by
        this rank alone, or planned with the other ranks' and read (a collective:
        ``prepare_global_plan`` decided for every rank)."""
        opened = self._open
        if opened is None:
            raise CheckpointingException("ShardstoreReader.read_data before read_metadata")
        where = f"checkpoint {opened.location.describe()}"
        together = isinstance(plan.storage_data, _ReadTogether) and plan.storage_data.together
        requests: list[tuple[ReadItem, torch.Tensor, ShardedTensor]] = []
        error = None
        for item in plan.items:
            try:  # a failure here is raised on every rank by the plan's gather, when together
                request = self._read_common_or_request(item, planner, opened, where)
            except CheckpointingException as exc:
                error = exc
                break
            except Exception as exc:
                error = CheckpointingException(f"{where}: reading {item.storage_index.fqn!r} failed: {exc}")
                error.__cause__ = exc
                break
            if request is not None:
                requests.append(request)
        if together:
            self._read_together(requests, opened, error, where)
        elif error is not None:
            raise error
        else:
            self._read_alone(requests, opened, where)
        for item, target, _ in requests:
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_common_or_request(
        self, item: ReadItem, planner: LoadPlanner, opened: _OpenCheckpoint, where: str,
    ) -> tuple[ReadItem, torch.Tensor, ShardedTensor] | None:
        """A common value ``item`` names, given to the planner (None); or the request for
        the region of an array it names: the target, and a ShardedTensor of the stored
        dtype that reads into it (its ``data``) where it is a contiguous CPU tensor of
        that dtype, else has no data (the read makes its result)."""
        key = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, _as_bytes(opened.common[key]))
            return None
        target = planner.resolve_tensor(item).detach()
        if key in opened.common:
            self._copy(item, target, _narrow(opened.common[key], _box(item)), where)
            planner.commit_tensor(item, target)
            return None
        array = opened.record.arrays[key]
        stored = from_zarr_name(array.dtype).torch_dtype
        direct = target.device.type == "cpu" and target.dtype == stored and holds_its_values(target)
        box = _box(item)
        request = ShardedTensor(key, target.reshape(tuple(item.lengths)) if direct else None, stored,
                                tuple(item.lengths), tuple(array.shape), tuple(s.start for s in box), None)
        return item, target, request

    def _read_alone(
        self, requests: list[tuple[ReadItem, torch.Tensor, ShardedTensor]], opened: _OpenCheckpoint, where: str,
    ) -> None:
        """Every request's region read by this rank, all at once, into its target where
        the request reads in place, else through a buffer of the stored dtype."""
        store = chunk_store_for(opened.location, self.io_concurrency)
        arrays: dict[str, ArrayChunks] = {}
        jobs, buffered = [], []
        for item, target, request in requests:
            key = request.key
            try:
                if key not in arrays:
                    arrays[key] = ArrayChunks.of(store, opened.record.arrays[key])
                stored = from_zarr_name(opened.record.arrays[key].dtype)
                out = tensor_to_numpy(request.data) if request.data is not None else np.empty(
                    tuple(item.lengths), stored.numpy_dtype)
                jobs += read_region(arrays[key], _box(item), out.reshape(tuple(item.lengths)))
                if request.data is None:
                    buffered.append((item, target, out, stored.torch_dtype))
            except CheckpointingException:
                raise
            except Exception as exc:
                raise CheckpointingException(f"{where}: reading {key!r} failed: {exc}") from exc
        run_reads(jobs, store.threads)
        for item, target, out, dtype in buffered:
            self._copy(item, target, numpy_to_tensor(out, dtype), where)

    def _read_together(
        self, requests: list[tuple[ReadItem, torch.Tensor, ShardedTensor]], opened: _OpenCheckpoint,
        error: BaseException | None, where: str,
    ) -> None:
        """Collective: the requests planned with every rank's and read
        (``ZarrLoadShardedStrategy.load_with_record``); ``error``, this rank's failure
        in making them, raised on every rank. A rank that fails before ``read_data``
        (a planner's ``finish_plan``) leaves the others waiting here for the process
        group's timeout."""
        asked = {i: request for i, (_, _, request) in enumerate(requests)}
        loaded = self._strategy.load_with_record(asked, opened.location, opened.record,
                                                 Group(self.process_group), local_error=error)
        for i, (item, target, request) in enumerate(requests):
            if loaded[i] is not request.data:  # else read in place
                self._copy(item, target, loaded[i], where)

    def _copy(self, item: ReadItem, target: torch.Tensor, source: torch.Tensor, where: str) -> None:
        """``source`` into ``target``; another dtype only where every value converts
        exactly, unless lossy casts are allowed (as ``shardstore.load``)."""
        if source.dtype != target.dtype and not self.allow_lossy_casts:
            source, changed = cast_checked(source, target.dtype)
            if changed is not None:
                raise CheckpointingException(
                    f"{where}: tensor {item.storage_index.fqn!r} is stored in another dtype than the state dict's "
                    f"{target.dtype}, which would change its value at index {list(changed)} of the requested part. "
                    "Request the stored dtype, or pass ShardstoreReader(allow_lossy_casts=True)"
                )
        target.copy_(source.reshape(target.shape))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: CheckpointId) -> bool:
        try:
            return open_read(bare_location(checkpoint_id)).is_shardstore
        except Exception:  # noqa: BLE001  (any reason: not a checkpoint we can read)
            return False

def _flat_common(common: dict[str, Any]) -> dict[str, Any]:
    """The common values by every name a request may give them: DCP's flattening (a
    list of plain values is one value, a list holding a tensor or a container is
    walked) and every leaf's own name (a list that held a DTensor when saved is walked
    by the request's flattening, whatever the common state holds of it now)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(common)
    for leaf in flatten(common):
        flat.setdefault(fqn(leaf.path), leaf.value)
    return flat

def _values_at_paths(
    common: dict[str, Any], paths: dict[str, StatePath], record: CommitRecord, where: str,
) -> dict[str, Any]:
    """The common values by the names DCP saved them under: each at its path in
    common.pt (``nested_common`` put it there); a name that is an array has none.

    Raises:
        CheckpointingException: a name that is neither (the checkpoint is damaged).
    """
    values: dict[str, Any] = {}
    for name, path in paths.items():
        if name in record.arrays:
            continue
        node: Any = common
        for part in path:
            held = part in node if isinstance(node, dict) else isinstance(node, list) and type(part) is int and part < len(node)
            if not held:
                raise CheckpointingException(
                    f"{where}: {name!r}, saved through DCP, is neither an array nor in the common state at "
                    f"{list(path)}; the checkpoint is damaged: load an earlier one"
                )
            node = node[part]
        values[name] = node
    return values

def _tensor_metadata(shape: tuple[int, ...], dtype: torch.dtype) -> TensorStorageMetadata:
    """One chunk covering the whole tensor: DCP then asks for each requested region
    once, and shardstore reads the chunks it touches."""
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype),
        size=torch.Size(shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size((0,) * len(shape)), sizes=torch.Size(shape))],
    )

def _array_metadata(shape: tuple[int, ...], zarr_dtype: str) -> TensorStorageMetadata:
    return _tensor_metadata(shape, from_zarr_name(zarr_dtype).torch_dtype)

@dataclass(frozen=True)
class _ReadTogether:
    """What ``ShardstoreReader.prepare_global_plan`` gives each rank
    (``LoadPlan.storage_data``): whether the ranks plan their reads together (one
    decision for all, so that every rank or none enters the collective)."""

    together: bool

def _box(item: ReadItem) -> tuple[slice, ...]:
    """A read item's box in the stored tensor: from its chunk's offset plus the offset
    inside it, its lengths along every axis."""
    chunk = item.storage_index.offset or (0,) * len(item.storage_offsets)
    return tuple(slice(c + o, c + o + n) for c, o, n in zip(chunk, item.storage_offsets, item.lengths))

def _narrow(tensor: torch.Tensor, box: tuple[slice, ...]) -> torch.Tensor:
    return tensor if tensor.ndim == 0 else tensor[box]

def _as_bytes(value: Any) -> io.BytesIO:
    """A common value as DCP's ``load_bytes`` takes it (a ``torch.save`` stream)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer
