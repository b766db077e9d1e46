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

The package is the entry for the doors (``shardstore.tools``): they import from
``shardstore.other_formats`` only the names of ``__all__`` (``tests/test_layering.py``),
each imported from its module on first use (``shardstore.lazy_exports``).
"""

from __future__ import annotations

__all__ = [
    "ExportSource",
    "FileFormat",
    "ExportStructure",
    "SAFETENSORS_FORMAT",
    "SAFETENSORS_INDEX",
    "SAFETENSORS_SINGLE",
    "TORCH_FILE_FORMAT",
    "TORCH_SUFFIXES",
    "TensorSpec",
    "detect",
    "encode_common",
    "formats",
    "make_parents",
    "named",
    "place_of_key",
    "place_value",
    "safetensors_metadata",
    "save_torch_file",
    "sparse_list_index",
    "write_safetensors",
]

from shardstore.lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "base": ("ExportSource", "FileFormat", "TensorSpec", "make_parents", "place_of_key", "place_value"),
    "layout": ("ExportStructure", "encode_common", "safetensors_metadata", "save_torch_file", "sparse_list_index"),
    "model_files": ("SAFETENSORS_INDEX", "SAFETENSORS_SINGLE"),
    "registry": ("detect", "formats", "named"),
    "safetensors": ("SAFETENSORS_FORMAT", "write_safetensors"),
    "torch_file": ("TORCH_FILE_FORMAT", "TORCH_SUFFIXES"),
})
