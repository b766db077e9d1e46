"""Megatron-Core's ``dist_checkpointing.strategies.resharding`` names, under the name its
users import: those of ``shardstore.compat.megatron.strategies.resharding``, re-exported
(the same objects, so a pickle naming a class by this module loads it, and type checkers
see each name).
"""

from __future__ import annotations

__all__ = [
    "ReformulationRestoreMetadata", "TensorReformulationMetadata",
    "apply_nd_flattened_tensors_reformulation", "get_reformulation_metadata",
    "is_nd_flattened_tensor", "nd_flattened_tensor_reformulated_global_shape",
    "reformulate_single_nd_flattened_tensor", "restore_nd_flattened_tensors_formulation",
]

from shardstore.compat.megatron.strategies.resharding import (
    ReformulationRestoreMetadata,
    TensorReformulationMetadata,
    apply_nd_flattened_tensors_reformulation,
    get_reformulation_metadata,
    is_nd_flattened_tensor,
    nd_flattened_tensor_reformulated_global_shape,
    reformulate_single_nd_flattened_tensor,
    restore_nd_flattened_tensors_formulation,
)
