"""Issue 16.5: plain tools open shardstore checkpoints: xarray (through zarr-python)
names every axis, so a group opens as a Dataset."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from shardstore import ShardedTensor, save
from tests.scenarios import global_tensor

xr = pytest.importorskip("xarray")


def test_xarray_opens_a_group_of_arrays(ckpt_dir: Path) -> None:
    fc1 = global_tensor("model/fc1", (6, 4), torch.float32)
    norm = global_tensor("model/norm", (4,), torch.bfloat16)
    save({"fc1": ShardedTensor.from_rank_offsets("model/fc1", fc1),
          "norm": ShardedTensor.from_rank_offsets("model/norm", norm),
          "step": ShardedTensor.from_rank_offsets("step", torch.tensor(7))}, ckpt_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr notes common.pt / metadata.json are not Zarr nodes
        ds = xr.open_zarr(ckpt_dir, group="model", consolidated=False)
        root = xr.open_zarr(ckpt_dir, consolidated=False)
    assert dict(ds.sizes) == {"fc1.0": 6, "fc1.1": 4, "norm.0": 4}
    assert np.array_equal(ds["fc1"].values, fc1.numpy())
    assert np.array_equal(ds["norm"].values.view(np.int16), norm.view(torch.int16).numpy())  # bfloat16 bits
    assert int(root["step"].values) == 7
