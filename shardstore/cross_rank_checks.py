"""The checks and gathers a save or load asks of every rank at once, under Megatron-Core's
names and signatures: the global sharding check (``validate_sharding_integrity``; the
checks themselves are ``planning.checks``), the warning on common states that differ
across ranks (``validate_common_state_dict``; ``protocol.common_state``), and every
rank's data-less sharded items (``determine_global_metadata``). Collective where their
docstrings say so; every collective runs through ``protocol.stage.run_stage``.
``shardstore.compat.megatron.validation`` offers them under Megatron's module name.
"""

from __future__ import annotations

__all__ = ["determine_global_metadata", "validate_common_state_dict", "validate_sharding_integrity"]

from typing import Any

from shardstore.dict_utils import nested_values
from shardstore.inputs.megatron_objects import converted_class
from shardstore.mapping import CommonStateDict, ShardedBase, ShardedStateDict
from shardstore.planning.checks import (
    FORMAT_NAME_LIMITS,
    check_layout,
    layout_of_global_metadata,
    ranks_with_differing_common_state,
)
from shardstore.planning.layout import GatheredShards
from shardstore.protocol.collectives import Group
from shardstore.protocol.common_state import (
    check_common_state_consistency,
    common_state_digests,
)
from shardstore.protocol.stage import Deliver, run_stage
from shardstore.stores.base import NameLimits


def validate_sharding_integrity(
    global_metadata: GatheredShards | list[list[ShardedBase]],
    common_state_dict: CommonStateDict | None = None,
    *,
    storage: NameLimits | None = FORMAT_NAME_LIMITS,
    where: str = "",
) -> None:
    """Every key can be stored, every element of every global tensor is covered exactly
    once by main replicas, shapes and dtypes agree across ranks, and ShardedObjects are
    complete. Megatron-Core's signature, with shardstore's options keyword-only.

    ``global_metadata``: Megatron-Core's, every rank's data-less ShardedTensors and
    ShardedObjects (shardstore's or Megatron-Core's own classes;
    ``determine_global_metadata(...)[1]``), which every rank passes and
    rank 0 alone checks, as in Megatron-Core; or the gathered layout (shardstore's save
    and load check it on the coordinator).
    ``common_state_dict``: every rank passes its common state, and the ranks whose
    common state differs from rank 0's are warned about (``validate_common_state_dict``;
    collective).
    ``storage``: where a save writes (its location's ``name_limits``; the default knows
    only the format's own names and limits), so the keys are checked first
    (``check_storable_keys``); None for a load's request, whose keys name what is stored.
    ``where``: the checkpoint, named in the errors.

    Raises:
        CheckpointingException: listing up to ten problems, each naming its key.
    """
    if common_state_dict is not None:
        validate_common_state_dict(common_state_dict, Group())
    layout = global_metadata
    if not isinstance(layout, GatheredShards):
        if Group().rank != 0:
            return
        layout = layout_of_global_metadata([[converted_class(item) for item in items] for items in layout])
    check_layout(layout, storage, where)


def validate_common_state_dict(common_state_dict: CommonStateDict, group: Group) -> None:
    """Collective: warns where a rank's common state differs from rank 0's (which is the
    one saved), as Megatron-Core's check does. The digests of every rank's entries go to
    the coordinator; only where they differ are the states compared in full
    (``check_common_state_consistency``). ``save`` does the same inside its plan
    stage, at no extra collective when nothing differs. Every collective runs through
    ``protocol.stage.run_stage``: a failure on any rank raises the same
    CheckpointingException on every rank."""
    if group.world_size == 1:
        return
    differing = run_stage(
        group, "Checking that the ranks' common states agree", lambda: common_state_digests(common_state_dict),
        reduce=ranks_with_differing_common_state, deliver=Deliver.BROADCAST,
    )
    check_common_state_consistency(common_state_dict, differing, group)


def determine_global_metadata(
    sharded_state_dict: ShardedStateDict, process_group: Any = None
) -> tuple[list[ShardedBase], list[list[ShardedBase]]]:
    """Collective (Megatron-Core's name): this rank's ShardedTensors and ShardedObjects
    without data, and every rank's, by rank (Megatron-Core's own mapping objects as
    shardstore's: ``inputs.megatron_objects.converted_class``).

    For callers of that API; shardstore's own save and load gather compact records to
    the coordinator instead (``protocol.plan_stage.gather_and_plan``). One stage
    (``protocol.stage.run_stage``: gathered to the coordinator, broadcast), so a failure
    on any rank raises the same CheckpointingException on every rank.
    """
    local: list[ShardedBase] = []

    def without_data() -> list[ShardedBase]:
        items = (converted_class(item) for item in nested_values(sharded_state_dict))
        local.extend(item.without_data() for item in items if isinstance(item, ShardedBase))
        return local

    everyone = run_stage(
        Group(process_group), "Gathering every rank's sharded tensors and objects (determine_global_metadata)",
        without_data, reduce=lambda gathered: gathered, deliver=Deliver.BROADCAST,
    )
    return local, everyone
