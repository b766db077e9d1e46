"""Tools built on the API: the ``shardstore`` command, the checkpoint manager, inspection
and diff, conversions, and the plug-ins that put shardstore under Megatron-Core's and
PyTorch DCP's own APIs.

May import: the dialects (``shardstore.compat``: the seed API's ``serialization`` and
``strategies``), the API and every layer below it. Nothing imports ``shardstore.tools``
except the ``shardstore`` package's lazy exports.
"""

__all__: list[str] = []
