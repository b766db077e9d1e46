"""Issue 33.1: a load in another dtype than the stored one is exact or refused, for
every pair of supported dtypes. Before, the check converted each value there and back
and compared, which every signed/unsigned pair passes by wrapping around: uint8 200
loaded as int8 -56, uint64 2**63 + 5 as int64 -9223372036854775803, int16 -1 as uint16
65535, silently.

The matrix test checks ``cast_checked`` (what every load calls) on boundary values of
each source type against an oracle in exact Python arithmetic: a value passes exactly
when the converted value is the same number (NaN: still NaN). A few loads through
``shardstore.load`` show the same at the API.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from shardstore import CheckpointingException, ShardedTensor, load, save
from shardstore.format import dtypes
from shardstore.format.dtypes import BY_TORCH, cast_checked, is_exact_conversion
from shardstore.strategies.zarr import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy

ALL = list(BY_TORCH)  # every dtype shardstore stores

_INTS = {
    0,
    1,
    2,
    -1,
    -2,
    17,
    100,
    127,
    128,
    129,
    -128,
    -129,
    255,
    256,
    257,
    448,
    449,
    2**11 + 1,
    2**15 - 1,
    2**15,
    -(2**15),
    -(2**15) - 1,
    2**16 - 1,
    2**16,
    57344,
    65504,
    65505,
    2**24,
    2**24 + 1,
    2**31 - 1,
    2**31,
    -(2**31),
    -(2**31) - 1,
    2**32 - 1,
    2**32,
    2**53,
    2**53 + 1,
    -(2**53) - 1,
    2**63 - 1,
    2**63,
    2**63 + 5,
    -(2**63),
    2**64 - 1,
}
_FLOATS = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    -2.5,
    0.1,
    1 / 3,
    math.nan,
    math.inf,
    -math.inf,
    127.0,
    128.0,
    255.0,
    256.0,
    -128.0,
    -129.0,
    448.0,
    464.0,
    57344.0,
    65504.0,
    65520.0,
    2.0**15,
    2.0**16,
    2.0**24 + 1,
    2.0**31,
    2.0**32,
    2.0**53 + 1,
    2.0**63,
    -(2.0**63),
    2.0**64,
    1e6,
    1e30,
    3.4e38,
    1e300,
    2.0**-10,
    2.0**-20,
    2.0**-130,
    5e-324,
]


def boundary_values(dtype: torch.dtype) -> torch.Tensor:
    """Boundary values of ``dtype``: min, max, -1, 0, 1, 2**(bits-1), 2**53 + 1, the
    limits of every other type, NaN, infinities, -0.0, fractions, subnormals (each
    rounded to ``dtype``, where it cannot hold it; complex: with zero and other
    imaginary parts)."""
    if dtype == torch.bool:
        return torch.tensor([False, True])
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        ints = sorted(
            v
            for v in _INTS | {info.min, info.max, 2 ** (info.bits - 1)}
            if info.min <= v <= info.max
        )
        return torch.tensor(ints, dtype=dtype) if dtype != torch.uint64 else _uint64(ints)
    real = dtype.to_real() if dtype.is_complex else dtype
    info = torch.finfo(real)
    reals = [
        *_FLOATS,
        info.max,
        info.min,
        info.tiny,
        info.smallest_normal * info.eps,
        info.eps,
        1 + info.eps,
    ]
    values = torch.tensor(reals, dtype=torch.float64).to(real)
    if not dtype.is_complex:
        return values
    imag = torch.tensor([1.0, -0.0, math.nan, 0.5, 2.0**-30, math.inf], dtype=torch.float64).to(
        real
    )
    return torch.cat(
        [
            torch.complex(values, torch.zeros_like(values)),
            torch.complex(torch.ones_like(imag), imag),
        ]
    )


def _uint64(values: list[int]) -> torch.Tensor:
    """uint64 values above 2**63 - 1, which torch.tensor cannot take as Python ints."""
    return torch.tensor([v - 2**64 if v >= 2**63 else v for v in values], dtype=torch.int64).view(
        torch.uint64
    )


def _number(value: bool | int | float | complex) -> tuple[object, object]:
    """A value as (real, imaginary) part, each exact: a Fraction, an infinity or "nan"."""

    def exact(part: float | int) -> object:
        if isinstance(part, float) and math.isnan(part):
            return "nan"
        return part if isinstance(part, float) and math.isinf(part) else Fraction(part)

    z = complex(value) if isinstance(value, complex) else value
    return (exact(z.real), exact(z.imag)) if isinstance(z, complex) else (exact(z), Fraction(0))


def _elements(t: torch.Tensor) -> list[bool | int | float | complex]:
    """Each element as a Python number holding it exactly."""
    if t.is_complex():
        return t.to(torch.complex128).tolist()
    if t.is_floating_point():
        return t.to(torch.float64).tolist()
    return t.tolist()


def _oracle_changed(values: torch.Tensor, dtype: torch.dtype) -> list[bool]:
    """Per element: does converting it to ``dtype`` give another number (the real part,
    for complex -> real, which must then have no imaginary part)?"""
    converted = (
        values.real.to(dtype) if values.is_complex() and not dtype.is_complex else values.to(dtype)
    )
    return [_number(a) != _number(b) for a, b in zip(_elements(values), _elements(converted))]


def _check(values: torch.Tensor, dtype: torch.dtype) -> list[bool]:
    """Per element: does ``cast_checked`` refuse it?"""
    verdicts = []
    for i in range(values.numel()):
        converted, changed = cast_checked(values[i : i + 1], dtype)
        assert converted.dtype == dtype
        verdicts.append(changed is not None)
        if changed is not None:
            assert changed == (0,)
    return verdicts


@pytest.mark.parametrize("source", ALL, ids=str)
def test_every_dtype_pair_is_exact_or_refused_on_boundary_values(source: torch.dtype) -> None:
    values = boundary_values(source)
    for target in ALL:
        expected = _oracle_changed(values, target)
        got = _check(values, target)
        wrong = [(v, e) for v, e, g in zip(_elements(values), expected, got) if e != g]
        assert not wrong, f"{source} -> {target}: (value, changed) misjudged: {wrong}"
        if is_exact_conversion(source, target):
            assert not any(expected), f"{source} -> {target} is declared exact but changes values"


@pytest.mark.parametrize(
    ("values", "target", "index"),
    [
        (torch.tensor([200, 0, 255, 1], dtype=torch.uint8), torch.int8, (0,)),
        (torch.tensor([1, 2, 3, -1], dtype=torch.int16), torch.uint16, (3,)),
        (_uint64([5, 2**63 + 5]), torch.int64, (1,)),
        (_uint64([2**53, 2**53 + 1]), torch.float64, (1,)),
        (_uint64([2**64 - 1]), torch.float64, (0,)),  # 2**64 as float64, out of uint64's range
        (
            torch.tensor([2**63 - 1]),
            torch.float64,
            (0,),
        ),  # 2**63 as float64; a round trip may saturate back
        (torch.tensor([0.0, math.nan]), torch.int64, (1,)),
        (torch.tensor([0.0, math.inf]), torch.float8_e4m3fn, (1,)),  # saturates to 448
        (torch.tensor([[0.0, 1.0], [math.nan, 1.0]]), torch.bool, (1, 0)),
        (torch.tensor([1 + 0j, 1 + 2j]), torch.float32, (1,)),
        (torch.tensor([1 + 0j, complex(0, math.nan)]), torch.int32, (1,)),
        (torch.tensor([-1.0, 2.0**31]), torch.int32, (1,)),
        (torch.tensor([0.0, -1.0]), torch.uint8, (1,)),
        (
            torch.tensor([1e-40, 1e-46], dtype=torch.float64),
            torch.float32,
            (0,),
        ),  # a subnormal rounds
    ],
)
def test_wrap_around_and_out_of_range_values_are_refused(
    values: torch.Tensor, target: torch.dtype, index: tuple[int, ...]
) -> None:
    assert cast_checked(values, target)[1] == index


@pytest.mark.parametrize(
    ("values", "target", "expected"),
    [
        (torch.tensor([-0.0, 3.0]), torch.int64, [0, 3]),  # -0.0 is the number 0
        (torch.tensor([-0.0, 1.0]), torch.bool, [False, True]),
        (_uint64([2**63, 2**64 - 2**11]), torch.float64, [2.0**63, 2.0**64 - 2**11]),
        (torch.tensor([0, 127, 1], dtype=torch.uint8), torch.int8, [0, 127, 1]),
        (torch.tensor([2**63 - 1, 0]), torch.uint64, [2**63 - 1, 0]),
        (torch.tensor([3 + 0j, complex(-2, -0.0)]), torch.int8, [3, -2]),
        (
            torch.tensor([math.nan, 1e-3]).double(),
            torch.float32,
            [math.nan, float(torch.tensor(1e-3))],
        ),  # float32's 1e-3
    ],
)
def test_values_that_stay_the_same_number_convert(
    values: torch.Tensor, target: torch.dtype, expected: list
) -> None:
    converted, changed = cast_checked(values, target)
    assert changed is None
    assert [_number(v) for v in _elements(converted)] == [_number(v) for v in expected]


def test_the_check_works_block_by_block_and_names_the_first_changed_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dtypes, "_CHECK_BLOCK", 1000)  # many blocks, whatever the test's size
    values = torch.zeros(7, 1001, dtype=torch.uint8)
    assert cast_checked(values, torch.int8)[1] is None
    values[5, 3] = 128
    values[6, 0] = 200
    assert cast_checked(values, torch.int8)[1] == (5, 3)
    assert cast_checked(values[5, 3], torch.int8)[1] == ()  # a zero-dim tensor has the empty index


# ------------------------------------------------------------------ through load


def _one(key: str, value: torch.Tensor) -> dict:
    return {key: ShardedTensor.from_rank_offsets(key, value)}


@pytest.fixture(scope="module")
def boundary_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("matrix") / "ckpt"
    save(
        {
            str(d).removeprefix("torch."): ShardedTensor.from_rank_offsets(
                str(d).removeprefix("torch."), boundary_values(d)
            )
            for d in ALL
        },
        path,
    )
    return path


@pytest.mark.parametrize(
    ("stored", "requested", "message"),
    [
        (
            torch.tensor([200, 0, 255, 1], dtype=torch.uint8),
            torch.int8,
            "200 at index [0] of the requested part into -56",
        ),
        (
            _uint64([1, 2**63 + 5]),
            torch.int64,
            "9223372036854775813 at index [1] of the requested part into -9223372036854775803",
        ),
        (
            torch.tensor([[0, 1], [-1, 2]], dtype=torch.int16),
            torch.uint16,
            "-1 at index [1, 0] of the requested part into 65535",
        ),
        (
            _uint64([2**53 + 1]),
            torch.float64,
            "9007199254740993 at index [0] of the requested part into 9007199254740992.0",
        ),
        (torch.tensor([1.0, math.nan]), torch.int64, "nan at index [1] of the requested part into"),
        (
            torch.tensor([1 + 0j, 1 + 1j], dtype=torch.complex64),
            torch.float32,
            "(1+1j) at index [1] of the requested part into 1.0",
        ),
    ],
)
def test_a_load_across_signedness_or_kinds_is_refused_naming_key_value_and_index(
    ckpt_dir: Path, stored: torch.Tensor, requested: torch.dtype, message: str
) -> None:
    save(_one("w", stored), ckpt_dir)
    with pytest.raises(CheckpointingException, match=r"tensor 'w' is stored as") as refused:
        load(_one("w", torch.empty(stored.shape, dtype=requested)), ckpt_dir)
    assert f"would change its value {message}" in str(refused.value)


def test_a_refused_cast_names_the_element_of_the_array(ckpt_dir: Path) -> None:
    """Rows 12-23 of a 48-row array (the second of four parts), one value of row 20 not
    an int8: element [20, 1] of the array. A load that reads the part in pieces
    (``read_shards_once``, chunks of 16 rows: rows 16-23 are a piece, where it is index
    [4, 1]) names the same element."""
    stored = torch.zeros(48, 2, dtype=torch.int16)
    stored[20, 1] = 300
    save(_one("w", stored), ckpt_dir, ZarrSaveShardedStrategy(max_chunk_bytes=16 * 2 * 2))
    for strategy, index in ((None, 8), (ZarrLoadShardedStrategy(read_shards_once=True), 4)):
        request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(12, 2, dtype=torch.int8), (0, 1, 4))}
        with pytest.raises(CheckpointingException, match=rf"300 at index \[{index}, 1\] of the requested part into 44 "
                                                         r"\(element \[20, 1\] of the array\)"):
            load(request, ckpt_dir, strategy, validate_access_integrity=False)


@pytest.mark.parametrize(
    ("stored", "requested"),
    [
        (torch.uint8, torch.int16),
        (torch.int8, torch.float16),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.complex64),
        (torch.bool, torch.float8_e5m2),
        (torch.float8_e4m3fn, torch.bfloat16),
    ],
)
def test_a_load_of_a_dtype_that_holds_every_stored_value_loads_them_all(
    boundary_checkpoint: Path, stored: torch.dtype, requested: torch.dtype
) -> None:
    key = str(stored).removeprefix("torch.")
    values = boundary_values(stored)
    loaded = load(_one(key, torch.empty(values.shape, dtype=requested)), boundary_checkpoint)[key]
    assert loaded.dtype == requested
    assert [_number(v) for v in _elements(loaded)] == [_number(v) for v in _elements(values)]


def test_a_load_of_values_that_fit_a_narrower_dtype_loads(tmp_path: Path) -> None:
    stored = _uint64([0, 7, 2**63 - 1])
    save(_one("w", stored), tmp_path / "ckpt")
    loaded = load(_one("w", torch.empty(3, dtype=torch.int64)), tmp_path / "ckpt")["w"]
    assert loaded.tolist() == [0, 7, 2**63 - 1]
