"""PyTorch DCP (``torch.distributed.checkpoint``) interop for ShardedTensors.

``CheckpointableShardedTensor`` implements DCP's ``_Checkpointable`` protocol, so a
Megatron-style sharded state dict can be saved and loaded by DCP itself (any world
size on load, DCP doing the resharding). DCP wants one object per key and rank;
``LocalShardsContainer`` holds several shards of one key.
``to_dcp_state_dict`` turns a sharded state dict into such a DCP state dict.

Both classes are thin wrappers: DCP only asks them for metadata (write items, chunk
lists) and for the tensor backing a chunk, which is the ShardedTensor's own data (a
view with the prepended axes), so DCP reads straight into it on load.
"""

from __future__ import annotations

__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer", "to_dcp_state_dict"]

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from shardstore.dict_utils import nested_values
from shardstore.errors import CheckpointingException
from shardstore.mapping import ShardedStateDict, ShardedTensor
from shardstore.planning.layout import block_shape


class CheckpointableShardedTensor(torch.Tensor):
    """A ShardedTensor that DCP can save and load (``_Checkpointable`` protocol).

    Args:
        data: the local tensor (``sh_ten.data``)
        sh_ten: the ShardedTensor it belongs to; flattened ranges are not supported
    """

    _data: torch.Tensor
    _sh_ten: ShardedTensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor) -> CheckpointableShardedTensor:
        if sh_ten.flattened_range is not None:
            raise CheckpointingException(
                f"{sh_ten.key!r}: DCP cannot represent flattened ranges; save it with shardstore.save"
            )
        block = data.reshape(block_shape(sh_ten))
        # Like a DTensor, the wrapper has the GLOBAL shape: DCP checks it against the
        # saved size; the local block is what __get_tensor_shard__ returns.
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(sh_ten.global_shape), dtype=block.dtype, device=block.device, requires_grad=False
        )
        wrapper._data = block
        wrapper._sh_ten = sh_ten
        return wrapper

    def __create_write_items__(
        self, fqn: str, sh_ten: CheckpointableShardedTensor, index: int | None = None
    ) -> list[WriteItem]:
        """One DCP write item: this shard's offsets and sizes in the global tensor."""
        offsets = torch.Size(self._sh_ten.global_offset)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets, index),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=self._data.shape),
                    properties=TensorProperties.create_from_tensor(self._data),
                    size=torch.Size(self._sh_ten.global_shape),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """This shard's chunk in DCP terms (offsets and sizes)."""
        return [ChunkStorageMetadata(offsets=torch.Size(self._sh_ten.global_offset), sizes=self._data.shape)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The tensor behind this shard (a view of ``sh_ten.data``)."""
        return self._data

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> CheckpointableShardedTensor:
        """Wraps a ShardedTensor (which must have data)."""
        if sh_ten.data is None:
            raise CheckpointingException(f"{sh_ten.key!r} has no data; call init_data() first")
        return cls(sh_ten.data, sh_ten)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # DCP only needs the protocol methods and tensor metadata; anything else would
        # silently act on an empty wrapper, so it is refused.
        raise NotImplementedError(f"{func} is not supported on {cls.__name__}")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{self.__class__.__name__}({self._sh_ten.key!r}, offset={self._sh_ten.global_offset})"


class LocalShardsContainer(torch.Tensor):
    """Several CheckpointableShardedTensors of one key on one rank, as one DCP object.

    Args:
        local_shards: the shards (CheckpointableShardedTensor) of the same key
    """

    _local_shards: list[CheckpointableShardedTensor]

    @staticmethod
    def __new__(cls, local_shards: list[torch.Tensor]) -> LocalShardsContainer:
        if not local_shards:
            raise CheckpointingException("LocalShardsContainer needs at least one shard")
        first = local_shards[0]
        global_shape = first._sh_ten.global_shape  # type: ignore[attr-defined]
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, global_shape, dtype=first.dtype, device=first.device, requires_grad=False
        )
        wrapper._local_shards = list(local_shards)
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise NotImplementedError(f"{func} is not supported on {cls.__name__}")

    def __create_write_items__(self, fqn: str, local_shards_cont: LocalShardsContainer) -> list[object]:
        """Write items of every shard, each with its index as DCP's lookup hint."""
        return [
            item
            for i, shard in enumerate(self._local_shards)
            for item in shard.__create_write_items__(fqn, shard, index=i)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [chunk for shard in self._local_shards for chunk in shard.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The shard at ``index.offset`` (``index.index`` is tried first)."""
        if index.index is not None and index.index < len(self._local_shards):
            hinted = self._local_shards[index.index]
            if torch.Size(hinted._sh_ten.global_offset) == index.offset:
                return hinted._data
        for shard in self._local_shards:
            if torch.Size(shard._sh_ten.global_offset) == index.offset:
                return shard._data
        raise CheckpointingException(f"No local shard of {index.fqn!r} at offset {tuple(index.offset or ())}")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{self.__class__.__name__}({len(self._local_shards)} shards)"


def to_dcp_state_dict(sharded_state_dict: ShardedStateDict) -> dict[str, torch.Tensor]:
    """A DCP state dict (``{key: checkpointable}``) from a sharded state dict's tensors.

    Non-main replicas are included: DCP de-duplicates identical write items itself.
    """
    by_key: dict[str, list[CheckpointableShardedTensor]] = {}
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor):
            by_key.setdefault(value.key, []).append(CheckpointableShardedTensor.from_sh_ten(value))
    return {k: v[0] if len(v) == 1 else LocalShardsContainer(v) for k, v in by_key.items()}
