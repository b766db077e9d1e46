"""Protocol: every collective stage of a save and a load. ``stage.run_stage`` is the one
shape they share (work on every rank, reduce on the coordinator, scatter or broadcast,
agree on failure, then point-to-point transfers); ``plan_stage`` is the plan stage,
``plan_cache`` its cached variant, ``common_state`` Megatron's common-state check, and
``collectives`` the process-group wrapper, the only code that calls ``torch.distributed``.

May import: ``shardstore.planning`` and the layers below it.

The package is the protocol's entry for the doors (``shardstore.tools``,
``shardstore.megatron``): they import from ``shardstore.protocol`` only the names of
``__all__`` (``tests/test_layering.py``), each imported from its module on first use
(``shardstore.lazy_exports``). No api module offers them: ``Group`` is the process group
a door hands to the api's calls, and ``run_stage`` the stage a door that must agree
across ranks runs (Megatron's ``verify_integrity`` load; the DCP writer's plan made in
``write_data``, delivered as ``Deliver`` says).
"""

from __future__ import annotations

__all__ = ["Deliver", "Group", "run_stage"]

from shardstore.lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"collectives": ("Group",), "stage": ("Deliver", "run_stage")})
