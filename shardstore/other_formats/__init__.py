"""Other tools' checkpoints, read without running their pickles: PyTorch DCP and Megatron-Core's ``torch_dist`` (``dcp``), Megatron-Core's deprecated ``zarr`` backend (``megatron_zarr``), behind one interface (``base``), listed once in ``registry``, where everything that meets another tool's checkpoint asks which format it is.

May import: ``shardstore.format``, ``shardstore.stores`` and the base modules.
"""
