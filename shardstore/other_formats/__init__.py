"""Other tools' checkpoints and model files, read without running their pickles, behind
one registry (``registry``), where everything that meets another tool's path asks which
format it is.

Checkpoint directories that ``load`` reads as they are (``base.OtherFormat``): PyTorch
DCP and Megatron-Core's ``torch_dist`` (``dcp``), Megatron-Core's deprecated ``zarr``
backend (``megatron_zarr``). Model files that shardstore converts from and to
(``base.FileFormat``): safetensors (``safetensors``, its files opened by
``model_files``) and ``torch.save`` files (``torch_file``); ``layout`` is what an export
into either keeps of a checkpoint's structure.

May import: ``shardstore.format``, ``shardstore.stores`` and the base modules.
"""

__all__: list[str] = []
