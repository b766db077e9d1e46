"""Megatron-Core's dialect of shardstore's API, in one package:

* ``entry_points``: ``install`` puts shardstore behind ``megatron.core.dist_checkpointing``'s
  module functions (also ``shardstore.megatron``);
* ``strategy``: the strategy plug-in for Megatron-Core <= 0.16 (also
  ``shardstore.tools.megatron_strategy``);
* ``core``: Megatron-Core's ``dist_checkpointing.core`` names (also ``shardstore.core``).

The seed API's other modules under Megatron's names, ``shardstore.validation`` and
``shardstore.exchange_utils``, hold logic the API itself runs (load planning, the
fully-parallel wrappers' distribution) and stay in the API's layer.
"""

from __future__ import annotations

__all__: list[str] = []
