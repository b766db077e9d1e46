"""Protocol: every collective stage of a save and a load (gather, plan once, scatter, agree on failure). The only code that calls ``torch.distributed`` (``collectives``).

May import: ``shardstore.planning`` and the layers below it.
"""
