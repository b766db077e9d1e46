"""What the engine's save (``engine.save``) and load (``engine.load``) share:
the path-or-Location a caller names a checkpoint by (``CheckpointDir``), the walk over a
caller's state dict that converts each leaf and builds each factory once
(``request_visitor``), and the ranks a save or load runs on (``group_of``).
"""

from __future__ import annotations

__all__ = ["CONTENT_METADATA_KEY", "CheckpointDir", "group_of", "request_visitor"]

from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

import torch.distributed as dist

from shardstore.errors import CheckpointingException
from shardstore.inputs.megatron_objects import convert_leaf
from shardstore.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedTensorFactory,
)
from shardstore.protocol.collectives import Group
from shardstore.stores.base import Location
from shardstore.utils import (
    holds_sharded_class,
)

CheckpointDir = Union[str, Path, Location]


# Where save(content_metadata=...) keeps it in the common state (Megatron-Core's key).
CONTENT_METADATA_KEY = "content_metadata"


def request_visitor(
    foreign_in_common: list[tuple] | None = None, factories: list[tuple[tuple, ShardedTensorFactory]] | None = None,
    plain: Callable[[tuple, Any], Any] | None = None,
) -> Callable[[tuple, Any, bool], Any]:
    """``flatten``'s visit for a save's or a load's state dict: each leaf converted
    (``inputs.megatron_objects.convert_leaf``, then ``plain``: a load's requests for
    plain tensors stored as arrays, ``inputs.plain_tensors.whole_array_requests``), each
    factory built (and, with ``factories``, remembered with its path for the load's
    merges); with ``foreign_in_common``, the paths of plain values that are (or hold, in
    a tuple) another library's sharded objects (``utils.holds_sharded_class``).

    Factories are built once, as Megatron-Core's ``apply_factories`` builds them: a
    factory in a factory's build is refused (it would be neither stored nor merged)."""
    building: list[ShardedTensorFactory] = []  # the factory whose build is being walked

    def visit(path: tuple, value: Any, expandable: bool) -> Any:
        if expandable:
            value = convert_leaf(path, value)
            if plain is not None:
                value = plain(path, value)
            if isinstance(value, ShardedTensorFactory):
                if factories is not None:
                    factories.append((path, value))
                building[:] = [value]
                return value.build()
        elif isinstance(value, ShardedTensorFactory):
            raise _factory_in_a_build(building[0], value, path)
        if (foreign_in_common is not None and not isinstance(value, (ShardedBase, LocalNonpersistentObject))
                and holds_sharded_class(value)):
            foreign_in_common.append(path)
        return value

    return visit


def _factory_in_a_build(outer: ShardedTensorFactory, inner: ShardedTensorFactory, path: tuple) -> CheckpointingException:
    where = "".join(f"[{k!r}]" for k in path)
    return CheckpointingException(
        f"The build of ShardedTensorFactory {outer.key!r} returned another ShardedTensorFactory {inner.key!r} (at "
        f"{where}): factories are built once, so it would be neither stored nor merged. Have the build return "
        "ShardedTensors (build the inner factory there and merge it in the outer merge_fn)"
    )


def group_of(process_group: dist.ProcessGroup | None, sharded_strategy: Any) -> Group:
    """The ranks a save or load runs on: ``process_group``, else the one the sharded
    strategy was made for (``ZarrSaveShardedStrategy(process_group=...)``, the seed's
    way to name it), else the whole world."""
    if process_group is None:
        process_group = getattr(sharded_strategy, "process_group", None)
    return Group(process_group)
