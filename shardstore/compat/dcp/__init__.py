"""PyTorch DCP's dialect of shardstore's API, in one package: its ``StorageWriter`` and
``StorageReader`` on shardstore's format, whose signatures (``checkpoint_id``, ``reset``,
``validate_checkpoint_id``) take a path or a Location as DCP's do.

* ``writer``: ``ShardstoreWriter``, a save through ``dcp.save``/``dcp.async_save`` (also
  ``shardstore.tools.dcp_storage`` and ``shardstore.ShardstoreWriter``);
* ``reader``: ``ShardstoreReader``, a load through ``dcp.load`` (also
  ``shardstore.tools.dcp_reader`` and ``shardstore.ShardstoreReader``);
* ``parts``: what the save's stages hand each other in DCP's plans and write results,
  pickled across ranks (also ``shardstore.tools.dcp_parts``);
* ``common_state``: the common state of a save, from the write results to ``common.pt``
  (also ``shardstore.tools.dcp_common_state``);
* ``exchange``: the group the writer's ranks exchange blocks on (also
  ``shardstore.tools.dcp_exchange``).

Each first name under ``shardstore.tools`` gives the very module here, so pickles that
name it (DCP's plans across ranks of different versions) load.
"""

from __future__ import annotations

__all__: list[str] = []
