"""Megatron-Core's ``dist_checkpointing.serialization`` names: ``save``, ``load`` and the
metadata queries, which run in ``shardstore.engine`` (``engine.save``, ``engine.load``).
Importing it registers Megatron-Core's ``("torch_dist", 1)`` save strategy too
(``strategies.torch``), so ``save(sharded_strategy=("torch_dist", 1))`` finds it.
"""

from __future__ import annotations

__all__ = [
    "get_default_load_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_save_sharded_strategy",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_preprocess",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "remove_sharded_tensors",
    "save",
    "save_preprocess",
    "verify_before_load",
    "verify_checkpoint_and_load_strategy",
]

import shardstore.compat.megatron.strategies  # noqa: F401  (registers ("torch_dist", 1))
from shardstore.engine.load import (
    get_default_load_sharded_strategy,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_preprocess,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    verify_before_load,
    verify_checkpoint_and_load_strategy,
)
from shardstore.engine.save import (
    get_default_save_common_strategy,
    get_default_save_sharded_strategy,
    save,
    save_preprocess,
)
