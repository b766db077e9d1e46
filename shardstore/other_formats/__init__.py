"""Other tools' checkpoints, read without running their pickles: PyTorch DCP and Megatron-Core's ``torch_dist`` (``dcp``), Megatron-Core's deprecated ``zarr`` backend (``megatron_zarr``), behind one interface (``base``).

May import: ``shardstore.format``, ``shardstore.stores`` and the base modules.
"""
