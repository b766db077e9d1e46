"""Megatron-Core's mapping objects as input: converted to shardstore's, once, at the API.

Real Megatron model code (``GPTModel.sharded_state_dict()``, the distributed
optimizer's) builds ``megatron.core.dist_checkpointing.mapping`` objects. ``save``,
``load`` and the queries call ``convert_megatron_objects`` first, so every layer below sees
only shardstore's classes. Objects are recognised by their module and class name, so
megatron-core is never imported (it stays optional) and any version with the same
fields converts: 0.14 (flattened ranges) through 0.16.

What converts: ``ShardedTensor`` (every field; an irregular grid, which Megatron 0.16
uses for distributed-optimizer buffers, is stored as a flattened range, see
``shardstore.inputs.irregular``), ``ShardedObject``, ``LocalNonpersistentObject``, and
``ShardedTensorFactory`` (its ``build_fn`` output is converted in turn, its
``merge_fn`` receives the loaded tensors as Megatron's would). PyTorch's DTensors
convert here too (``shardstore.inputs.dtensors``).
"""

from __future__ import annotations

__all__ = ["convert_leaf", "convert_megatron_objects", "converted_class"]

import dataclasses
from typing import Any

from shardstore.dict_utils import dict_list_map_inplace
from shardstore.inputs.dtensors import dtensor_factory, fqn, is_dtensor, with_dtensors_converted
from shardstore.inputs.irregular import irregular_as_flat, is_irregular
from shardstore.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)

MEGATRON_MODULES = ("megatron.core.dist_checkpointing",)


def _is_megatron(value: Any, name: str) -> bool:
    cls = type(value)
    return cls.__name__ == name and cls.__module__.startswith(MEGATRON_MODULES)


def _fields(value: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The dataclass fields of ``value`` that shardstore's class also has."""
    present = {f.name for f in dataclasses.fields(value)} if dataclasses.is_dataclass(value) else set(vars(value))
    return {n: getattr(value, n) for n in names if n in present}


_TENSOR_FIELDS = tuple(f.name for f in dataclasses.fields(ShardedTensor))
_OBJECT_FIELDS = tuple(f.name for f in dataclasses.fields(ShardedObject))


def convert_one(value: Any) -> Any:
    """shardstore's equivalent of one Megatron mapping object (others unchanged); a
    ShardedTensor on an irregular grid (ours or Megatron's) becomes the factory that
    stores it as a flattened range (``shardstore.inputs.irregular``)."""
    value = converted_class(value)
    if isinstance(value, ShardedTensor) and is_irregular(value):
        return irregular_as_flat(value)
    return value


def converted_class(value: Any) -> Any:
    """shardstore's class for one Megatron mapping object, fields unchanged (others
    unchanged). What a factory's build returns is converted so: an irregular shard
    stays a ShardedTensor (the storage core stores those as they are), since a factory
    made of it would be one inside a build, which is never built."""
    if _is_megatron(value, "ShardedTensor"):
        return ShardedTensor(**_fields(value, _TENSOR_FIELDS))
    if _is_megatron(value, "ShardedObject"):
        return ShardedObject(**_fields(value, _OBJECT_FIELDS))
    if _is_megatron(value, "LocalNonpersistentObject"):
        return LocalNonpersistentObject(value.obj)
    if _is_megatron(value, "ShardedTensorFactory"):
        build = value.build_fn

        def build_converted(*args: Any) -> Any:
            return dict_list_map_inplace(converted_class, with_dtensors_converted(build(*args)))

        return ShardedTensorFactory(
            value.key, value.data, build_converted, value.merge_fn, value.replica_id,
            getattr(value, "flattened_range", None),
        )
    return value


def convert_megatron_objects(state_dict: Any) -> Any:
    """Converts, in place, every Megatron mapping object in a nested state dict, after
    DTensors became factories keyed by their fully qualified names
    (``shardstore.inputs.dtensors``, which copies the containers that hold them instead).

    Returns the state dict (a bare mapping object is converted and returned)."""
    return dict_list_map_inplace(convert_one, with_dtensors_converted(state_dict))


def convert_leaf(path: tuple[Any, ...], value: Any) -> Any:
    """What ``convert_megatron_objects`` makes of the leaf at ``path`` of a state dict: a DTensor
    becomes its factory, keyed by its fully qualified name; a Megatron mapping object
    becomes shardstore's (``convert_one``). For a walk that visits each leaf once
    (``dict_utils.flatten``)."""
    if is_dtensor(value):
        return dtensor_factory(fqn(path), value)
    return convert_one(value)
