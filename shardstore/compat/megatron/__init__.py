"""Megatron-Core's dialect of shardstore's API, in one package:

* ``strategies``: Megatron-Core's strategy classes, whose methods take a checkpoint
  directory (those Megatron-Core has also under ``shardstore.strategies``);
* ``serialization`` (with ``serialization_load`` and ``serialization_common``): the seed
  API's module functions, ``save``, ``load`` and the metadata queries (also
  ``shardstore.serialization``, and ``shardstore.save`` and its siblings);
* ``checkpoint_dirs``: where the seed API's checkpoint directories lead (the one place
  its paths become what the core takes: a Location, an opened checkpoint);
* ``entry_points``: ``install`` puts shardstore behind ``megatron.core.dist_checkpointing``'s
  module functions (also ``shardstore.megatron``);
* ``strategy``: the strategy plug-in for Megatron-Core <= 0.16 (also
  ``shardstore.tools.megatron_strategy``);
* ``core``: Megatron-Core's ``dist_checkpointing.core`` names (also ``shardstore.core``);
* ``validation`` and ``exchange_utils``: the names of Megatron-Core's modules of those
  names (also ``shardstore.validation``, ``shardstore.exchange_utils``). The checks a
  load runs live in the API under names of their own (``load_strictness``,
  ``cross_rank_checks``), the fully-parallel distribution in ``strategies.shard_exchange``;
  these modules re-export them.
"""

from __future__ import annotations

__all__: list[str] = []
