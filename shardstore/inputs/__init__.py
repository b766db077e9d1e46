"""API layer, boundary converters: the objects other libraries hand to ``save``/``load``
(Megatron-Core's own mapping classes, PyTorch DTensors, irregular grids) become
shardstore's ``ShardedTensor``/``ShardedObject`` here, once, so nothing below the API
knows they exist.

May import: ``shardstore.mapping``, ``shardstore.dict_utils``, ``shardstore.errors``.
"""

__all__: list[str] = []
