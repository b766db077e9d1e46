"""Megatron-Core's ``dist_checkpointing.core`` names: the exception type, the
``metadata.json`` record (``shardstore.format.config``, re-exported here on purpose), and
the garbage-collector pause a save and load run under (``gc_paused``, whose home is
``gc_pause``). ``shardstore.core`` re-exports its names.

``save_config`` writes ``metadata.json`` into a checkpoint directory (one rank only);
into a committed shardstore checkpoint only where its record does not list one.
``maybe_load_config`` and ``check_is_distributed_checkpoint`` read it from a checkpoint
directory, as it is (``opened.bare_location``); the core reads it at a Location
(``format.read_config``).
"""

from __future__ import annotations

__all__ = [
    "CONFIG_FNAME", "CheckpointingConfig", "CheckpointingException", "SaveOptions",
    "check_is_distributed_checkpoint", "gc_paused", "maybe_load_config", "save_config",
]

import os

from shardstore.errors import CheckpointingException
from shardstore.format import (
    CONFIG_FNAME,
    CheckpointingConfig,
    SaveOptions,
    read_config,
    write_config,
)
from shardstore.gc_pause import gc_paused
from shardstore.stores import Location


def save_config(config: CheckpointingConfig, checkpoint_dir: str | os.PathLike | Location) -> None:
    """Megatron-Core's ``save_config``: writes ``metadata.json`` into ``checkpoint_dir``
    (call on one rank only). Into a committed shardstore checkpoint only where its record
    does not list one (``engine.walk.write_dir``): Megatron-Core's own save writes it after
    the commit."""
    # imported here: the read entries import torch's DCP, which shardstore.core's many importers need not
    from shardstore.engine.walk import write_dir

    write_config(config, write_dir(checkpoint_dir, writes_config=True))


def maybe_load_config(checkpoint_dir: str | os.PathLike | Location) -> CheckpointingConfig | None:
    """Megatron-Core's ``maybe_load_config``: the config in ``checkpoint_dir``, or None
    where there is no ``metadata.json``. As in Megatron-Core, an empty path and a path
    that is a file are no checkpoint (None), not an error."""
    if checkpoint_dir == "":
        return None
    # imported here, as in save_config
    from shardstore.opened import bare_location

    return read_config(bare_location(checkpoint_dir))


def check_is_distributed_checkpoint(checkpoint_dir: str | os.PathLike | Location) -> bool:
    """Megatron-Core's ``check_is_distributed_checkpoint``: whether ``checkpoint_dir``
    holds a ``metadata.json``. Like Megatron-Core this looks for the config only; use
    ``shardstore.format.is_committed`` to know whether the save completed."""
    return maybe_load_config(checkpoint_dir) is not None
