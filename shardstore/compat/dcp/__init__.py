"""PyTorch DCP's dialect of shardstore's API, in one package: its ``StorageWriter`` and
``StorageReader`` on shardstore's format, whose signatures (``checkpoint_id``, ``reset``,
``validate_checkpoint_id``) take a path or a Location as DCP's do.

* ``writer``: ``ShardstoreWriter``, a save through ``dcp.save``/``dcp.async_save`` (also
  ``shardstore.ShardstoreWriter``);
* ``reader``: ``ShardstoreReader``, a load through ``dcp.load`` (also
  ``shardstore.ShardstoreReader``);
* ``parts``: what the save's stages hand each other in DCP's plans and write results,
  pickled across ranks;
* ``common_state``: the common state of a save, from the write results to ``common.pt``;
* ``exchange``: the group the writer's ranks exchange blocks on.

Users import the two classes from ``shardstore``; the modules have no other names.
"""

from __future__ import annotations

__all__: list[str] = []
