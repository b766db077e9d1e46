"""Planning, pure: no I/O, no collectives. From the gathered shard records of every rank
(``layout``, ``checks``) to the frozen per-rank save and load plans (``plans``), decided
once by the coordinator. Testable without ranks.

May import: ``shardstore.format``, ``shardstore.stores`` (name limits), ``shardstore.mapping``,
``shardstore.errors``.

The package is the planning's entry for the layers above: the doors
(``shardstore.tools``, ``shardstore.megatron``) import from ``shardstore.planning`` only
the names of ``__all__`` (``tests/test_layering.py``), never one of its modules. They
need none today: a door plans through the save pipeline (``shardstore.execution``). A
name a door needs joins ``__all__``, imported from its module on first use as
``shardstore.format`` does (``shardstore.lazy_exports``).
"""

from __future__ import annotations

__all__: list[str] = []
