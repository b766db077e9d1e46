"""Protocol: every collective stage of a save and a load. ``stage.run_stage`` is the one
shape they share (work on every rank, reduce on the coordinator, scatter or broadcast,
agree on failure, then point-to-point transfers); ``plan_stage`` is the plan stage,
``plan_cache`` its cached variant, ``common_state`` Megatron's common-state check, and
``collectives`` the process-group wrapper, the only code that calls ``torch.distributed``.

May import: ``shardstore.planning`` and the layers below it.
"""
