"""Megatron-Core's dialect of shardstore's API, in one package:

* ``entry_points``: ``install`` puts shardstore behind ``megatron.core.dist_checkpointing``'s
  module functions (also ``shardstore.megatron``);
* ``strategy``: the strategy plug-in for Megatron-Core <= 0.16 (also
  ``shardstore.tools.megatron_strategy``);
* ``core``: Megatron-Core's ``dist_checkpointing.core`` names (also ``shardstore.core``);
* ``validation`` and ``exchange_utils``: the names of Megatron-Core's modules of those
  names (also ``shardstore.validation``, ``shardstore.exchange_utils``). The logic they
  name runs inside the API (a load's plan, the fully-parallel wrappers' distribution), so
  it lives there under names of its own (``load_strictness``, ``cross_rank_checks``,
  ``strategies.shard_exchange``) and these modules re-export it.
"""

from __future__ import annotations

__all__: list[str] = []
