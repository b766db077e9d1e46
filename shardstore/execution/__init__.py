"""Execution: a rank runs its own plan. ``pipeline`` (``SavePipeline``: the one
composition of a save, which every door opens), host staging of device tensors
(``staging``), writing its chunks and its part of the commit (``save``), reading,
agreeing and exchanging regions (``load``), and placing what was read into the request's
tensors (``loaded``).

May import: ``shardstore.protocol``, ``shardstore.planning`` and the layers below them.

The package is the execution's entry for the doors (``shardstore.tools``,
``shardstore.megatron``): they import from ``shardstore.execution`` only the names of
``__all__`` (``tests/test_layering.py``), each imported from its module on first use
(``shardstore.lazy_exports``). The doors that write a checkpoint themselves (the array
writer, the DCP writer) open the save pipeline here; the api offers only whole saves.
"""

from __future__ import annotations

__all__ = ["ArrayWrites", "RankSave", "SavePipeline", "fail_before_staging"]

from shardstore.lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"array_writes": ("ArrayWrites",), "pipeline": ("RankSave", "SavePipeline"),
                                             "save": ("fail_before_staging",)})
