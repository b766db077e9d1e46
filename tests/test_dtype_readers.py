"""Issue 33.5: every dtype shardstore stores opens in TensorStore and zarr-python.

A complex array's ``zarr.json`` said ``"fill_value": 0.0``; Zarr v3 spells a complex
fill value ``[re, im]``. shardstore's own load and verify never read it, but TensorStore
refused that array ("Error parsing object member fill_value") and zarr-python the whole
group, since it parses the consolidated metadata of every array at once. Checkpoints
saved before keep loading and verifying (their format version is unchanged).

Extension types' hex fill values (``0x`` and the bits) also read alike in both: zarr
read bfloat16 ``0x3f80`` (1.0) as the float16 bits 1.875, and refused float8's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr

from shardstore import SaveOptions, ShardedTensor, StorageLayout, load, save, verify
from shardstore.format.dtypes import BY_TORCH, from_torch, tensor_to_numpy
from shardstore.format.records import array_record
from tests.test_dtype_matrix import boundary_values

ALL = list(BY_TORCH)


def _key(dtype: torch.dtype) -> str:
    return "dtypes/" + str(dtype).removeprefix("torch.")


def _bits(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values).view(np.uint8).tobytes()


# per array: each array's own zarr.json is what these tests read and edit (the default packs them)
PER_ARRAY = SaveOptions(layout=StorageLayout(pack_arrays_up_to=0))


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("readers") / "ckpt"
    save({_key(d): ShardedTensor.from_rank_offsets(_key(d), boundary_values(d)) for d in ALL}, path, options=PER_ARRAY)
    return path


def _assert_zero(fill: object, dtype: torch.dtype) -> None:
    """``fill`` is zero of the type: +0 (not -0.0), both parts for complex types."""
    parts = np.asarray(fill).astype(np.complex128 if dtype.is_complex else np.float64).reshape(-1)
    for part in (parts.real, parts.imag) if dtype.is_complex else (parts,):
        assert part.tolist() == [0.0] and not np.signbit(part).any(), (dtype, fill)


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_every_dtype_opens_in_tensorstore_and_zarr_python(
    every_dtype: Path, dtype: torch.dtype
) -> None:
    key, expected = _key(dtype), from_torch(dtype)
    stored = _bits(tensor_to_numpy(boundary_values(dtype)))
    document = json.loads((every_dtype / key / "zarr.json").read_text())
    assert document["data_type"] == expected.zarr_name

    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{every_dtype / key}/"}}
    array = ts.open(spec, open=True).result()
    assert array.dtype.numpy_dtype == expected.numpy_dtype
    _assert_zero(array.fill_value, dtype)
    assert _bits(array.read().result()) == stored

    for opened in (
        zarr.open_array(every_dtype / key, mode="r"),
        zarr.open_group(every_dtype, mode="r")[key],
    ):
        assert opened.dtype == expected.numpy_dtype
        _assert_zero(opened.fill_value, dtype)
        assert _bits(opened[...]) == stored


def test_the_checkpoint_of_every_dtype_verifies(every_dtype: Path) -> None:
    report = verify(every_dtype)
    assert report.ok, str(report)
    assert report.arrays_checked == len(ALL)


def test_a_checkpoint_with_the_old_complex_fill_value_still_loads_and_verifies(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What earlier saves wrote: ``0.0`` for complex types, in the array's ``zarr.json``
    and in the consolidated metadata the record's digest covers."""
    zero = array_record.zero_fill_value
    values = {
        "freqs_cis": torch.polar(torch.ones(4, 2), torch.arange(8.0).reshape(4, 2)),
        "w": torch.ones(3),
    }
    with monkeypatch.context() as old:
        old.setattr(
            array_record,
            "zero_fill_value",
            lambda name: 0.0 if name.startswith("complex") else zero(name),
        )
        save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in values.items()}, ckpt_dir, options=PER_ARRAY)
    assert json.loads((ckpt_dir / "freqs_cis" / "zarr.json").read_text())["fill_value"] == 0.0
    root = json.loads((ckpt_dir / "zarr.json").read_text())
    assert root["consolidated_metadata"]["metadata"]["freqs_cis"]["fill_value"] == 0.0

    loaded = load(
        {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in values.items()},
        ckpt_dir,
    )
    for k, v in values.items():
        assert torch.equal(loaded[k], v), k
    report = verify(ckpt_dir)
    assert report.ok, str(report)


def test_verify_still_flags_a_complex_fill_value_that_is_not_zero(ckpt_dir: Path) -> None:
    save(
        {"c": ShardedTensor.from_rank_offsets("c", torch.zeros(2, dtype=torch.complex64))}, ckpt_dir,
        options=PER_ARRAY,
    )
    path = ckpt_dir / "c" / "zarr.json"
    for fill in (1.0, [0.0, 1.0]):
        path.write_text(json.dumps({**json.loads(path.read_text()), "fill_value": fill}))
        problems = {p.key: p.message for p in verify(ckpt_dir).problems}
        assert "fill_value" in problems.get("c/zarr.json", ""), (fill, problems)


def _write_array(path: Path, data_type: str, fill_value: object) -> None:
    """An array of two elements and no chunks: every reader returns its fill value."""
    path.mkdir(parents=True)
    one_byte = data_type.startswith("float8")
    document = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [2],
        "data_type": data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill_value,
        "codecs": [
            {"name": "bytes"}
            if one_byte
            else {"name": "bytes", "configuration": {"endian": "little"}}
        ],
    }
    (path / "zarr.json").write_text(json.dumps(document))


@pytest.mark.parametrize(
    ("data_type", "fill_value", "bits"),
    [
        ("bfloat16", "0x3f80", "803f"),  # 1.0
        ("bfloat16", "0x7fc1", "c17f"),  # a NaN with a payload
        ("bfloat16", "0x8000", "0080"),  # -0.0
        ("float8_e4m3fn", "0x38", "38"),  # 1.0
        ("float8_e4m3fn", "0x7f", "7f"),  # its NaN
        ("float8_e5m2", "0xfc", "fc"),  # -inf
        ("bfloat16", "NaN", None),
        ("float8_e5m2", "-Infinity", "fc"),
        ("float8_e4m3fn", 448.0, "7e"),
    ],
)
def test_extension_dtype_fill_values_read_the_same_in_zarr_and_tensorstore(
    tmp_path: Path, data_type: str, fill_value: object, bits: str | None
) -> None:
    _write_array(tmp_path / "a", data_type, fill_value)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{tmp_path / 'a'}/"}}
    by_tensorstore = _bits(ts.open(spec, open=True).result().read().result())
    by_zarr = _bits(zarr.open_array(tmp_path / "a", mode="r")[...])
    assert by_zarr == by_tensorstore, (by_zarr.hex(), by_tensorstore.hex())
    if bits is not None:
        assert by_zarr.hex() == bits * 2


@pytest.mark.parametrize("fill_value", ["0x3f", "0x3f800000", "0x3_80", "0xzzzz"])
def test_a_malformed_hex_fill_value_of_an_extension_dtype_is_refused(
    tmp_path: Path, fill_value: str
) -> None:
    _write_array(tmp_path / "a", "bfloat16", fill_value)
    with pytest.raises(Exception, match="fill"):
        zarr.open_array(tmp_path / "a", mode="r")


def test_a_big_endian_bfloat16_array_reads_the_same_in_zarr_and_tensorstore(tmp_path: Path) -> None:
    """A bfloat16 array whose ``bytes`` codec says ``"endian": "big"`` (TensorStore writes
    one when asked): zarr-python with shardstore's data type viewed its chunks' bytes as
    host-order bfloat16, unswapped, and returned garbage (1.25 read as -1.6e-19) without
    an error, where TensorStore reads the values; a zarr-python round trip of such an
    array read back other values than it wrote."""
    from shardstore.format.zarr_dtypes import BFloat16

    values = (np.arange(8, dtype=np.float32) + 1.25).astype(from_torch(torch.bfloat16).numpy_dtype)
    metadata = {"shape": [8], "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4]}},
                "data_type": "bfloat16", "codecs": [{"name": "bytes", "configuration": {"endian": "big"}}]}
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{tmp_path / 'a'}/"}, "metadata": metadata}
    ts.open(spec, create=True).result().write(values).result()
    assert (tmp_path / "a" / "c" / "0").read_bytes()[:2] == values[:1].view(np.uint8).tobytes()[::-1]
    as_float = values.astype(np.float32)
    assert np.array_equal(zarr.open_array(tmp_path / "a", mode="r")[...].astype(np.float32), as_float)
    written = zarr.create_array(tmp_path / "b", shape=(8,), chunks=(4,), dtype=BFloat16(endianness="big"),
                                compressors=None, fill_value=0)
    written[:] = values
    assert np.array_equal(zarr.open_array(tmp_path / "b", mode="r")[...].astype(np.float32), as_float)
    by_tensorstore = ts.open({**spec, "kvstore": {**spec["kvstore"], "path": f"{tmp_path / 'b'}/"}, "metadata": {}},
                             open=True).result().read().result()
    assert np.array_equal(np.asarray(by_tensorstore).astype(np.float32), as_float)
