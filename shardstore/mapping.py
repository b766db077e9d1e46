"""What a rank holds: the classes that describe how local data maps onto global data.

The main entry point is ``ShardedTensor.from_rank_offsets``: it wraps a local tensor and
says which fragment of the global tensor it is. ``ShardedObject`` does the same for
arbitrary picklable objects, ``ShardedTensorFactory`` transforms tensors before save and
after load, and ``LocalNonpersistentObject`` marks values that are never stored.

Names and semantics follow Megatron-Core's ``dist_checkpointing.mapping``.
"""

from __future__ import annotations

__all__ = [
    "CommonStateDict", "FactoryBuildFn", "FactoryMergeFn", "LocalNonpersistentObject", "MeshReplicaId", "ReplicaId",
    "ShardedBase", "ShardedObject", "ShardedStateDict", "ShardedTensor", "ShardedTensorFactory",
    "StateDict", "apply_factories", "apply_factory_merges", "as_integers", "fill_unknown_last_axes",
    "is_main_replica", "unstorable_reason",
]

import logging
import math
import numbers
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, Union

import torch

from shardstore.dict_utils import dict_list_map_inplace
from shardstore.errors import CheckpointingException

logger = logging.getLogger(__name__)

# These type definitions are just hints to differentiate a plain model state
# dict (StateDict) from a state dict with tensors replaced with ShardedTensors
# (ShardedStateDict).
StateDict = dict[str, Any]
CommonStateDict = dict[str, Any]
ShardedStateDict = dict[str, Any]
ReplicaId = Union[int, tuple[int, ...]]


class MeshReplicaId(tuple):
    """The replica id of a block of a DTensor (``shardstore.inputs.dtensors``): its
    coordinates on the mesh dimensions the DTensor is replicated over. Ranks outside
    the DTensor's mesh (another data-parallel group's copy of a TP submesh) cannot be
    seen from it, so equal blocks of one key held by several ranks with such ids are
    replicas of each other, one of them main, as DCP's planner deduplicates them
    (``planning.layout.GatheredShards.from_gathered``). Their values are not compared,
    as DCP does not compare them: copies that differ save one of them per block."""

    __slots__ = ()

_logged_deprecations: dict[str, bool] = {}


class ShardedBase(ABC):
    """Base class for ShardedTensor, ShardedObject and ShardedTensorFactory."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Codifies the constraints on metadata attributes."""

    @abstractmethod
    def without_data(self) -> ShardedBase:
        """Returns a new instance with ``data=None``."""


def unstorable_reason(data: Any) -> str | None:
    """Why ``data`` is no tensor whose memory holds its values (a save copies them out
    of that memory), said with what to do instead; None for a dense tensor with memory
    (of any dtype: the format's dtypes are checked apart). A plain ``torch.Tensor`` or
    ``nn.Parameter`` costs three attribute reads."""
    if not isinstance(data, torch.Tensor):
        return (f"its data is a {type(data).__qualname__}, not a torch.Tensor: make it a tensor "
                "(torch.as_tensor(data)), or keep the value in the common state")
    if type(data) not in (torch.Tensor, torch.nn.Parameter) and _is_fake(data):
        return ("its data is a FakeTensor, which holds no values (made under FakeTensorMode): "
                "save real tensors, made outside that mode")
    if data.is_nested:
        return ("its data is a nested tensor, which no array of one shape holds: save its components "
                "(data.unbind()) as tensors of their own, or keep it in the common state")
    if data.layout != torch.strided:
        return (f"its data is a {str(data.layout).removeprefix('torch.')} tensor: only dense (strided) tensors "
                "are stored as arrays; pass data.to_dense(), or keep the sparse tensor in the common state "
                "(pickled whole)")
    if data.device.type == "meta":
        return ("its data is on the meta device and holds no values: materialize it first "
                "(module.to_empty(device=...), then initialize or load it)")
    return None


def _is_fake(data: torch.Tensor) -> bool:
    """Whether ``data`` is a FakeTensor (imported only for a tensor subclass)."""
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(data))


@dataclass
class ShardedTensor(ShardedBase):
    """Represents a mapping between a local tensor and a global tensor.

    The global tensor consists of many local tensors distributed between processes.

    Args:
        key: unique identifier of a global tensor
        data: local tensor data. Can be None only for consistency validation
        dtype: tensor dtype
        local_shape: local tensor shape
        global_shape: global tensor shape
        global_offset: offset of a local tensor in a global tensor, in elements
        axis_fragmentations: global tensor fragmentation of each axis
        replica_id: the local tensor's replication with respect to other processes
        prepend_axis_num: number of axes prepended to the local tensor to reflect the
            global tensor shape (like unsqueezing the local tensor)
        allow_shape_mismatch: on load, the stored global shape may differ from the
            expected one (e.g. padded tensors)
        flattened_range: a slice applied to the flattened ``local_shape`` tensor to
            obtain the tensor stored as ``data``
    """

    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.local_shape = tuple(self.local_shape)
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(self.axis_fragmentations)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Codifies the constraints on metadata attributes.

        ``from_rank_offsets`` and ``from_rank_offsets_flat`` always meet them.

        Raises:
            CheckpointingException: naming the key and the violated constraint.
        """
        def fail(msg: str) -> None:
            raise CheckpointingException(f"ShardedTensor {self.key!r}: {msg}")

        if self.data is not None:
            if self.data.dtype != self.dtype:
                fail(f"data dtype {self.data.dtype} does not match declared dtype {self.dtype}")
            self.check_held_shape()
        for what, values in (("global shape", self.global_shape), ("global offset", self.global_offset),
                             ("local shape", self.local_shape)):
            try:
                list(map(operator.index, values))
            except TypeError:
                fail(f"{what} {values} holds a value that is not an integer")
        if len(self.global_shape) != len(self.global_offset):
            fail(f"global shape {self.global_shape} and offset {self.global_offset} differ in length")
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            fail(
                f"local shape {self.local_shape} with {self.prepend_axis_num} prepended axes "
                f"does not match the rank of global shape {self.global_shape}"
            )
        if self.axis_fragmentations is not None:  # irregular grids: shardstore.inputs.irregular
            for off, sh in zip(self.global_offset[self.prepend_axis_num :], self.local_shape):
                if sh != 0 and off % sh != 0:
                    fail(f"global offset {off} is not divisible by local shape {sh}")
        if self.flattened_range is not None:
            fr = self.flattened_range
            if fr.step not in (None, 1):
                fail(f"flattened_range must have step 1, got {fr}")
            if not (0 <= fr.start <= fr.stop <= math.prod(self.local_shape)):
                fail(f"flattened_range {fr} is outside the local shape {self.local_shape}")

    @property
    def held_dtype(self) -> torch.dtype:
        """The dtype a save stores: ``data``'s as it is now, else the declared ``dtype``.

        A trainer may swap the wrapped parameter's ``.data`` for another dtype after this
        ShardedTensor was made (``p.data = p.data.to(torch.bfloat16)``); a save stores
        what the tensor holds, and a cached plan of the old dtype is not reused."""
        return self.data.dtype if self.data is not None else self.dtype

    def unstorable_data(self) -> str | None:
        """Why ``data`` holds no values a save can write as an array, and what to do
        instead (``unstorable_reason``); None when it does, or holds none."""
        return None if self.data is None else unstorable_reason(self.data)

    def check_held_shape(self) -> None:
        """Raises a CheckpointingException naming the key when ``data``'s shape is not the
        one this ShardedTensor declares (``local_shape``, or the flattened range's length):
        unlike a dtype, a shape changed since this ShardedTensor was made leaves its
        place in the global tensor unknown."""
        if self.data is None:
            return
        expected = (
            self.local_shape
            if self.flattened_range is None
            else (self.flattened_range.stop - self.flattened_range.start,)
        )
        if tuple(self.data.shape) != tuple(expected):
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: data shape {tuple(self.data.shape)} does not match expected {expected}; "
                "make the ShardedTensor from the tensor as it is now (a tensor's shape cannot change under it)"
            )

    @property
    def has_regular_grid(self) -> bool:
        """Alias for having a regular sharding grid."""
        return self.axis_fragmentations is not None

    def global_slice(self) -> tuple[int | slice, ...]:
        """The part of the global tensor this ShardedTensor covers (ints on prepended axes)."""
        return tuple(
            chain(
                self.global_offset[: self.prepend_axis_num],
                (
                    slice(off, off + sh)
                    for off, sh in zip(self.global_offset[self.prepend_axis_num :], self.local_shape)
                ),
            )
        )

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """Offset of the whole local chunk in the global array of chunks."""
        chunk_offset = list(self.global_offset[: self.prepend_axis_num])
        for off, sh in zip(self.global_offset[self.prepend_axis_num :], self.local_shape):
            if sh == 0 or off % sh != 0:
                raise CheckpointingException(f"{self}: offset {off} is not a multiple of {sh}")
            chunk_offset.append(off // sh)
        return tuple(chunk_offset)

    def max_allowed_chunks(self) -> tuple[int, ...]:
        """The chunk size along each axis implied by ``axis_fragmentations``."""
        if self.axis_fragmentations is None:
            raise CheckpointingException(f"{self.key!r} has no regular sharding grid")
        chunks = []
        for axis_sh, axis_fragm in zip(self.global_shape, self.axis_fragmentations):
            if not self.allow_shape_mismatch and axis_sh % axis_fragm != 0:
                raise CheckpointingException(
                    f"{self.key!r}: axis shape ({axis_sh}) not divisible by axis fragmentation ({axis_fragm})"
                )
            chunks.append(axis_sh // axis_fragm)
        return tuple(chunks)

    def without_data(self) -> ShardedTensor:
        return replace(self, data=None)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """Builds a ShardedTensor from offsets given in process ranks.

        Args:
            key: unique key
            data: local tensor data
            rank_offsets: each ``(axis, axis_rank_offset, axis_fragm)`` says that if the
                global tensor is divided into ``axis_fragm`` fragments along ``axis``,
                ``data`` is fragment number ``axis_rank_offset``.
            replica_id: see ShardedTensor
            prepend_axis_num: see ShardedTensor
            flattened_range: must be None; use ``from_rank_offsets_flat`` instead
            init_kwargs: passed to ShardedTensor
        """
        if flattened_range is not None:
            raise ValueError(
                "Cannot instantiate a flat ShardedTensor with `from_rank_offsets`; "
                "use `from_rank_offsets_flat` instead"
            )
        ndim = data.ndim + prepend_axis_num
        global_offset = [0] * ndim
        global_shape = [1] * prepend_axis_num + list(data.shape)
        axis_fragmentations = [1] * ndim
        seen_axes = set()
        for axis, axis_rank_offset, axis_fragm in rank_offsets:
            if (
                not 0 <= axis < ndim
                or axis in seen_axes
                or axis_fragm < 1
                or not 0 <= axis_rank_offset < axis_fragm
            ):
                raise CheckpointingException(
                    f"Invalid rank offsets {rank_offsets} for key {key!r}: each must be (axis, offset, "
                    f"fragments) with a distinct axis in [0, {ndim}) and 0 <= offset < fragments"
                )
            seen_axes.add(axis)
            local_axis_shape = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = axis_fragm * local_axis_shape
            global_offset[axis] = axis_rank_offset * local_axis_shape
            axis_fragmentations[axis] = axis_fragm
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(axis_fragmentations),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: tuple[int, ...],
        *args: tuple[int, int, int],
        flattened_range: slice | None = None,
        **kwargs: Any,
    ) -> ShardedTensor:
        """Like ``from_rank_offsets`` for a flat ``data`` that is a contiguous range
        ``flattened_range`` of a local tensor of shape ``non_flat_local_shape``
        (distributed-optimizer style).
        """
        if flattened_range is None:
            raise CheckpointingException(
                "Cannot instantiate a non-flat ShardedTensor with `from_rank_offsets_flat`; "
                "use `from_rank_offsets` instead"
            )
        if data.ndim != 1:
            raise CheckpointingException(f"{key!r}: flat data must be 1-D, got shape {tuple(data.shape)}")
        if flattened_range.stop - flattened_range.start != data.numel():
            raise CheckpointingException(
                f"{key!r}: flattened_range {flattened_range} does not match {data.numel()} elements"
            )
        meta = torch.empty(tuple(non_flat_local_shape), dtype=data.dtype, device="meta")
        template = cls.from_rank_offsets(key, meta, *args, **kwargs)
        return replace(template, data=data, flattened_range=flattened_range)

    def init_data(self, device: str | torch.device, init_fn: Callable = torch.empty) -> None:
        """Allocates ``data`` (only if it is None) on ``device`` with ``init_fn``."""
        if self.data is not None:
            return
        self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)
        if self.flattened_range is not None:
            self.data = self.data.flatten()[self.flattened_range.start : self.flattened_range.stop]

    def narrow(self, dim: int, start: int, length: int) -> list[ShardedTensor]:
        """Analogue of ``torch.narrow`` applied to the local tensor on every rank.

        Args:
            dim: dimension to narrow, not counting prepended axes; negative counts from
                the last local axis, as in ``torch.narrow``
            start: start element
            length: length of the slice

        Returns:
            A list of ShardedTensors: always one for non-flat tensors; zero or one for
            flat ones (only ``dim=0`` is supported for flat tensors).
        """
        dim = self._local_axis(dim)
        gdim = dim + self.prepend_axis_num
        local_len = self.local_shape[dim]
        if local_len == 0 or self.global_shape[gdim] % local_len or self.global_offset[gdim] % local_len:
            raise CheckpointingException(f"{self.key!r}: cannot narrow an irregular axis {dim}")
        global_shape = _with(self.global_shape, gdim, self.global_shape[gdim] * length // local_len)
        global_offset = _with(self.global_offset, gdim, self.global_offset[gdim] * length // local_len)
        if self.flattened_range is None:
            new_data = self.data.narrow(dim, start, length) if self.data is not None else None
            return [
                replace(
                    self,
                    data=new_data,
                    local_shape=_with(self.local_shape, dim, length),
                    global_shape=global_shape,
                    global_offset=global_offset,
                )
            ]
        if dim != 0:
            raise CheckpointingException(
                f"{self.key!r}: flat ShardedTensors can only be narrowed along axis 0, got {dim}"
            )
        local_shape = _with(self.local_shape, dim, length)
        row_volume = math.prod(local_shape[1:])
        shifted_start = self.flattened_range.start - row_volume * start
        shifted_stop = self.flattened_range.stop - row_volume * start
        split_volume = row_volume * length
        if shifted_stop <= 0 or shifted_start >= split_volume:
            return []
        new_range = slice(max(shifted_start, 0), min(shifted_stop, split_volume))
        first = new_range.start - shifted_start
        new_data = (
            self.data[first : first + new_range.stop - new_range.start] if self.data is not None else None
        )
        return [
            replace(
                self,
                data=new_data,
                local_shape=local_shape,
                global_shape=global_shape,
                global_offset=global_offset,
                flattened_range=new_range,
            )
        ]

    def _local_axis(self, dim: int) -> int:
        """``dim`` as a non-negative axis of the local tensor (``torch.narrow``'s rule)."""
        ndim = len(self.local_shape)
        if not -ndim <= dim < ndim:
            raise CheckpointingException(
                f"{self.key!r}: cannot narrow axis {dim} of a local tensor with {ndim} axes "
                f"(local shape {self.local_shape}); pass an axis in [{-ndim}, {ndim})"
            )
        return dim % ndim

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key={self.key!r})"


def _with(values: tuple[int, ...], index: int, value: int) -> tuple[int, ...]:
    return values[:index] + (value,) + values[index + 1 :]


def as_integers(values: Any, described: str) -> tuple[int, ...]:
    """``values`` as Python ints (numpy's and 0-d torch integers too), or a
    CheckpointingException saying that ``described`` (the tensor or object and what of
    it) holds a value that is no integer: a float offset would be truncated by the
    checks' arrays, or name a shard file no load finds."""
    try:
        return tuple(map(operator.index, values))
    except TypeError:
        raise CheckpointingException(f"{described} {tuple(values)} holds a value that is not an integer") from None


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the "main" replica: integer 0 or an iterable of zeros. numpy's integers
    and 0-d torch tensors are integers (a replica id computed with them), not iterables.

    Setting correct replica ids is the application's responsibility.
    """
    if isinstance(replica_id, numbers.Integral):  # int, bool and numpy's integers
        return replica_id == 0
    if isinstance(replica_id, torch.Tensor) and replica_id.ndim == 0:
        return bool(replica_id == 0)
    return all(r == 0 for r in replica_id)


class LocalNonpersistentObject:
    """An object that is never stored: on load, the local version is put back.

    Wrapping a value of the state dict in it means: not saved; on load, ``obj`` is
    placed in the returned state dict as is.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        """Returns the original object."""
        return self.obj

    def __repr__(self) -> str:
        return f"LocalNonpersistentObject({self.obj!r})"


@dataclass
class ShardedObject(ShardedBase):
    """Represents a mapping between a local object and a global object.

    Unlike ShardedTensor, the sharding of a global object cannot change between save
    and load: it is a fully-sharded tensor with atomic elements of arbitrary type.

    Args:
        key: unique identifier of a global object
        data: local object data. Can be None only for consistency validation
        global_shape: global object shape, in shards
        global_offset: offset of the local object in the global object, in shards
        replica_id: local object's replication with respect to other processes
    """

    key: str
    data: object = field(repr=False)
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        # plain ints: the shard's file is named after them (``unique_key``)
        self.global_shape = as_integers(self.global_shape, f"ShardedObject {self.key!r}: global shape")
        self.global_offset = as_integers(self.global_offset, f"ShardedObject {self.key!r}: global offset")
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: global shape {self.global_shape} and offset "
                f"{self.global_offset} differ in length"
            )
        if self.global_shape and self.global_shape[-1] == UNKNOWN_AXIS and self.global_offset[-1] >= 0:
            shape, offset = self.global_shape[:-1], self.global_offset[:-1]  # an old key's: see empty_from_unique_key
        else:
            shape, offset = self.global_shape, self.global_offset
        if any(not 0 <= o < s for o, s in zip(offset, shape)):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: offset {self.global_offset} lies outside shape {self.global_shape}"
            )

    def without_data(self) -> ShardedObject:
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """``<key>/shard_<offset>_<shape>``: names this shard among all shards of the key."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    @property
    def old_unique_key(self) -> str:
        """The shard's name in checkpoints of old Megatron-Core versions, whose keys
        lack the last axis of the shape (``empty_from_unique_key``): loads look for it
        where ``unique_key`` is not stored, as Megatron's do."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape[:-1]))
        return f"{self.key}/shard_{offset}_{shape}"

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key={self.key!r})"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """Builds a data-less ShardedObject from ``<key>/shard_<offset>_<shape>``.

        A key of an old Megatron-Core checkpoint lacks the LAST axis of the shape (one
        number fewer than the offset): that axis is ``-1`` (``UNKNOWN_AXIS``) here, as in
        Megatron; ``fill_unknown_last_axes`` completes it from all shards of the key.
        """
        try:
            key, shard_key = unique_key.rsplit("/", 1)
            shard_str, offset, shape = shard_key.split("_")
            if shard_str != "shard":
                raise ValueError("missing 'shard' prefix")
            global_offset, global_shape = _axes(offset), _axes(shape)
        except ValueError as exc:
            raise CheckpointingException(f"Malformed sharded object key {unique_key!r}: {exc}") from exc
        if len(global_shape) + 1 == len(global_offset):
            global_shape = (*global_shape, UNKNOWN_AXIS)
        return cls(key, None, global_shape, global_offset, replica_id)


def _axes(text: str) -> tuple[int, ...]:
    """The numbers of a unique key's offset or shape (``"1.0"``); ``""`` is no axis (a
    0-dimensional object's, or the shape of an old key of a 1-dimensional one)."""
    return tuple(map(int, text.split("."))) if text else ()


UNKNOWN_AXIS = -1
"""The last axis of a ShardedObject's shape read from an old key, until filled."""


def fill_unknown_last_axes(objects: Iterable[ShardedObject]) -> None:
    """Sets the unknown last axis of the shapes read from old keys, in place.

    For every key whose shards came from old keys (``empty_from_unique_key`` gives them
    a last axis of ``UNKNOWN_AXIS``), the last axis becomes the largest last offset
    among that key's shards plus one, as Megatron-Core's ``load_sharded_metadata``
    does. ``objects``: all shards of each key, as a checkpoint lists them; other
    objects are left as they are.
    """
    last_offsets: dict[str, int] = {}
    unknown = [obj for obj in objects if obj.global_shape and obj.global_shape[-1] == UNKNOWN_AXIS]
    for obj in unknown:
        last_offsets[obj.key] = max(last_offsets.get(obj.key, 0), obj.global_offset[-1])
    for obj in unknown:
        obj.global_shape = (*obj.global_shape[:-1], last_offsets[obj.key] + 1)


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, slice | None], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """Transforms a tensor into a sub-state-dict before saving, and back after loading.

    The sub-state-dict must depend only on the ``build_fn`` arguments (key, data,
    replica_id, flattened_range), so the optimizer can apply the same transformation
    to its states as to the parameters.

    Args:
        key: unique identifier of the factory
        data: original model parameter to transform
        build_fn: turns the tensor into a sharded state dict
        merge_fn: turns the loaded sub-state-dict back into one tensor (inverse of build_fn)
        replica_id: factory replication with respect to other processes
        flattened_range: extra flattening applied to the ShardedTensors it produces
    """

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        """Builds a ShardedStateDict from the original tensor."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """No reasonable checks can be applied."""

    def without_data(self) -> ShardedTensorFactory:
        return replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Turns ShardedTensorFactories into their built sub-state-dicts, in place."""

    def apply(x: Any) -> Any:
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(apply, sharded_state_dict)


def apply_factory_merges(
    x1: StateDict, x2: ShardedStateDict, key: tuple[str, ...] = ()
) -> StateDict:
    """Applies the merges of the ShardedTensorFactories in ``x2`` to ``x1``, in place.

    Args:
        x1: state dict loaded from the checkpoint
        x2: subset of ``x1`` (in terms of keys) with ShardedTensorFactory values
        key: path of the current recursion, for error messages

    Returns:
        ``x1``, modified in place
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    where = "/".join(map(str, key)) or "<root>"
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise ValueError(f"Factory merge at {where}: key {k!r} missing from the loaded state dict")
            x1[k] = apply_factory_merges(x1[k], v2, key=key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(f"Factory merge at {where}: list lengths differ ({len(x1)} vs {len(x2)})")
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key=key + (str(i),))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not isinstance(k, int) or not 0 <= k < len(x1):
                raise ValueError(f"Factory merge at {where}: invalid list index {k!r}")
            x1[k] = apply_factory_merges(x1[k], v2, key=key + (str(k),))
    else:
        raise ValueError(f"Factory merge at {where}: cannot merge {type(x1).__name__} with {type(x2).__name__}")
    return x1
