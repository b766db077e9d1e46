"""Planning, pure: no I/O, no collectives. From the gathered shard records of every rank (``layout``) to the frozen per-rank save and load plans (``plans``), decided once by the coordinator.

May import: ``shardstore.format``, ``shardstore.mapping``, ``shardstore.errors``. Testable without ranks.
"""
