"""The name Megatron-Core's optimizer-resharding code imports from its torch_dist strategy
module (``dist_checkpointing.strategies.torch``), so that code runs on shardstore.

shardstore writes no torch_dist checkpoints (its format is ``strategies.zarr``'s) and
reads Megatron's through ``strategies.other_formats``; the reformulation API lives in
``strategies.resharding``.
"""

from __future__ import annotations

from shardstore.strategies.resharding import get_reformulation_metadata

__all__ = ["get_reformulation_metadata"]
