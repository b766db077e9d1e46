"""Megatron-Core's dialect of shardstore's API, in one package, over the engine
(``shardstore.engine``, which every door runs and which never imports this package):

* ``serialization``: Megatron-Core's module of that name, the engine's save, load and
  metadata queries (also ``shardstore.serialization``);
* ``strategies``: the strategies that are Megatron-Core's alone (``fully_parallel``,
  ``torch``, ``checkpointable``, ``resharding``, ``forked_writes``, ``shard_exchange``;
  ``shardstore.strategies`` offers them with the engine's under Megatron-Core's names);
* ``entry_points``: ``install`` puts shardstore behind ``megatron.core.dist_checkpointing``'s
  module functions (also ``shardstore.megatron``);
* ``strategy``: the strategy plug-in for Megatron-Core <= 0.16;
* ``core``, ``validation`` and ``exchange_utils``: the names of Megatron-Core's modules
  of those names (also ``shardstore.core``, ``shardstore.validation``,
  ``shardstore.exchange_utils``). The checks a load runs live in the API under names of
  their own (``load_strictness``, ``cross_rank_checks``), the fully-parallel
  distribution in ``strategies.shard_exchange``; these modules re-export them.
"""

from __future__ import annotations

__all__: list[str] = []
