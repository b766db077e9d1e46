"""torch <-> numpy <-> Zarr v3 data types, and zero-copy views between torch and numpy.

bfloat16 and float8 have no numpy type of their own; ml_dtypes provides them. A tensor
of such a type is viewed bit for bit (``int16``/``uint8`` in between), never converted
through float32, so saving and loading are exact and copy-free.
"""

from __future__ import annotations

__all__ = [
    "BY_TORCH", "BY_ZARR_NAME", "CORE_DATA_TYPES", "DType", "ITEMSIZE_BY_ZARR_NAME", "ShapedTensorSize", "UnsupportedDTypeError",
    "byte_view", "cast_checked", "from_torch", "from_zarr_name", "holds_its_values", "is_exact_conversion",
    "numpy_to_tensor", "numpy_to_torch_dtype_dict", "tensor_to_numpy", "torch_to_numpy_dtype_dict", "values_in_order",
]

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

# The data types of the Zarr v3 core specification: every Zarr implementation reads them.
# shardstore's others (bfloat16, float8_e4m3fn, float8_e5m2) are extension data types
# that zarr-python 3.1 only knows once shardstore is installed; TensorStore knows them.
CORE_DATA_TYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
})


@dataclass(frozen=True)
class DType:
    """One supported element type under its three names.

    Attributes:
        zarr_name: the Zarr v3 ``data_type`` (what TensorStore writes).
        torch_dtype: the torch dtype.
        numpy_dtype: the numpy dtype (ml_dtypes for bfloat16/float8).
        bits_dtype: the torch integer dtype of the same width, used for bit views of
            types numpy cannot hold directly; None when numpy holds the type itself.
    """

    zarr_name: str
    torch_dtype: torch.dtype
    numpy_dtype: np.dtype
    bits_dtype: torch.dtype | None = None

    @property
    def itemsize(self) -> int:
        return self.numpy_dtype.itemsize


_DTYPES = [
    DType("bool", torch.bool, np.dtype(np.bool_)),
    DType("int8", torch.int8, np.dtype(np.int8)),
    DType("int16", torch.int16, np.dtype(np.int16)),
    DType("int32", torch.int32, np.dtype(np.int32)),
    DType("int64", torch.int64, np.dtype(np.int64)),
    DType("uint8", torch.uint8, np.dtype(np.uint8)),
    DType("uint16", torch.uint16, np.dtype(np.uint16)),
    DType("uint32", torch.uint32, np.dtype(np.uint32)),
    DType("uint64", torch.uint64, np.dtype(np.uint64)),
    DType("float16", torch.float16, np.dtype(np.float16)),
    DType("float32", torch.float32, np.dtype(np.float32)),
    DType("float64", torch.float64, np.dtype(np.float64)),
    DType("complex64", torch.complex64, np.dtype(np.complex64)),
    DType("complex128", torch.complex128, np.dtype(np.complex128)),
    DType("bfloat16", torch.bfloat16, np.dtype(ml_dtypes.bfloat16), torch.int16),
    DType("float8_e4m3fn", torch.float8_e4m3fn, np.dtype(ml_dtypes.float8_e4m3fn), torch.uint8),
    DType("float8_e5m2", torch.float8_e5m2, np.dtype(ml_dtypes.float8_e5m2), torch.uint8),
]

BY_ZARR_NAME: dict[str, DType] = {d.zarr_name: d for d in _DTYPES}
BY_TORCH: dict[torch.dtype, DType] = {d.torch_dtype: d for d in _DTYPES}
# Bytes per element by Zarr name: what planning multiplies millions of times at 4,096 ranks.
ITEMSIZE_BY_ZARR_NAME: dict[str, int] = {d.zarr_name: d.itemsize for d in _DTYPES}

# The seed API's module-level tables (Megatron's zarr strategy exposes them).
torch_to_numpy_dtype_dict: dict[torch.dtype, np.dtype] = {d.torch_dtype: d.numpy_dtype for d in _DTYPES}
numpy_to_torch_dtype_dict: dict[np.dtype, torch.dtype] = {d.numpy_dtype: d.torch_dtype for d in _DTYPES}


class UnsupportedDTypeError(TypeError):
    """A dtype shardstore cannot store; the message lists the supported ones."""


def from_torch(dtype: torch.dtype) -> DType:
    try:
        return BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedDTypeError(
            f"dtype {dtype} is not supported; supported: {sorted(str(d) for d in BY_TORCH)}"
        ) from None


def from_zarr_name(name: object) -> DType:
    try:
        return BY_ZARR_NAME[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise UnsupportedDTypeError(
            f"Zarr data type {name!r} is not supported; supported: {sorted(BY_ZARR_NAME)}"
        ) from None


def holds_its_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory holds its values in order, so that ``tensor_to_numpy``
    is a view of them: contiguous, and no conjugate or negative view (``tensor.conj()``,
    ``_neg_view``: flags over memory holding other values, which numpy refuses); never
    a sparse tensor (its memory holds indices and values, and CSR has no strides)."""
    return tensor.layout == torch.strided and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def values_in_order(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself where its memory holds its values in order
    (``holds_its_values``), else one contiguous copy of its values (a strided view such
    as a column, ``x[::2]`` or an expanded tensor; a conjugate or negative view, its
    flag resolved)."""
    if holds_its_values(tensor):
        return tensor
    return tensor.resolve_conj().resolve_neg().contiguous()


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as flat bytes: a view of its memory where it holds its values
    in order (``holds_its_values``), else of a copy (``values_in_order``; ``reshape``
    alone does not copy a 1-D strided view). A tensor of 0 or 1 elements is contiguous
    to torch whatever its strides (numpy's empty arrays have stride 0, a single element
    sliced from a column keeps the column's), but a byte view of a wider dtype needs a
    last stride of 1: it is given unit strides first."""
    tensor = values_in_order(tensor.detach())
    if tensor.numel() <= 1:
        tensor = tensor.as_strided((tensor.numel(),), (1,))
    return tensor.reshape(-1).view(torch.uint8)


def tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (no copy, exact bits)."""
    dtype = from_torch(tensor.dtype)
    if tensor.requires_grad:  # numpy() refuses a tensor autograd tracks; any other is read as it is
        tensor = tensor.detach()
    if dtype.bits_dtype is None:
        return tensor.numpy()
    return tensor.view(dtype.bits_dtype).numpy().view(dtype.numpy_dtype)


def numpy_to_tensor(array: np.ndarray, torch_dtype: torch.dtype) -> torch.Tensor:
    """A tensor sharing ``array``'s memory, reinterpreted as ``torch_dtype`` (no copy)."""
    dtype = from_torch(torch_dtype)
    if dtype.bits_dtype is None:
        return torch.from_numpy(array.view(dtype.numpy_dtype))
    bits_numpy = torch_to_numpy_dtype_dict[dtype.bits_dtype]
    return torch.from_numpy(array.view(bits_numpy)).view(dtype.torch_dtype)


# Float types without an infinity: converting a type that has one into them is lossy.
_NO_INFINITY = {torch.float8_e4m3fn}


def is_exact_conversion(src: torch.dtype, dst: torch.dtype) -> bool:
    """True if every value of ``src`` survives conversion to ``dst`` unchanged.

    What a load may do without being asked: float16 -> float32, int32 -> int64,
    bool -> anything, int8 -> float16. Not: float32 -> int64 (truncates), float32 ->
    float16 (overflows to inf), anything -> bool (every non-zero becomes True).
    """
    if src == dst or src == torch.bool:
        return True
    if dst == torch.bool or src.is_complex and not dst.is_complex:
        return False
    if dst.is_complex:
        component = {torch.complex64: torch.float32, torch.complex128: torch.float64}[dst]
        return is_exact_conversion(src.to_real() if src.is_complex else src, component)
    if src.is_floating_point:
        if not dst.is_floating_point or dst in _NO_INFINITY:
            return False
        s, d = torch.finfo(src), torch.finfo(dst)
        return _mantissa_bits(d) >= _mantissa_bits(s) and d.max >= s.max and d.smallest_normal <= s.smallest_normal
    s_info = torch.iinfo(src)
    if dst.is_floating_point:
        d = torch.finfo(dst)
        largest = max(-s_info.min, s_info.max)
        return largest <= 2 ** (_mantissa_bits(d) + 1) and largest <= d.max
    d_info = torch.iinfo(dst)
    return d_info.min <= s_info.min and s_info.max <= d_info.max


def cast_checked(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """``values`` converted to ``dtype``, and the index of the first value the conversion
    changed (None: every value converts to the same number).

    "The same number" is the mathematical value: 200 (uint8) is not -56 (int8), 2**53 + 1
    (int64) is not 2**53 (float64), 0.5 is not 0, 1 + 2j is not 1, 2 is not True. Where
    both sides are no number, NaN stays NaN (its payload may change); infinities must
    stay infinite. -0.0 converted to an integer or bool is 0 (False): the same number,
    so it passes, and only the sign of the zero is lost. A complex value converts to a
    real type only when its imaginary part is exactly zero, and only its real part is
    converted (the imaginary part is not silently dropped, it is checked).

    Where the types guarantee it (``is_exact_conversion``) nothing is checked. Else the
    values are checked against the converted ones, ``_CHECK_BLOCK`` elements at a time
    (vectorised numpy, on the host), so the check's scratch memory stays a few MiB
    whatever the tensor's size (the converted tensor is the result itself). The test is range first, then value (``_unchanged``):
    a round trip alone (convert, convert back, compare) misses wrap-around, which every
    signed/unsigned pair round-trips (uint8 200 -> int8 -56 -> uint8 200), and a
    conversion of a value out of the target's range is undefined in C.
    """
    if values.is_complex() and not dtype.is_complex:
        converted = values.real.to(dtype)  # the imaginary part is checked, not dropped with a warning
    else:
        converted = values.to(dtype)
    if is_exact_conversion(values.dtype, dtype):
        return converted, None
    flat_values, flat_converted = values.reshape(-1), converted.reshape(-1)
    for start in range(0, flat_values.numel(), _CHECK_BLOCK):
        block = slice(start, start + _CHECK_BLOCK)
        changed = np.flatnonzero(~_unchanged(_host_numpy(flat_values[block]), _host_numpy(flat_converted[block])))
        if changed.size:
            return converted, tuple(int(i) for i in np.unravel_index(start + int(changed[0]), tuple(values.shape)))
    return converted, None


# Elements ``cast_checked`` checks at a time: the float64 copies and masks of one block
# are at most about 7 MiB (three 2 MiB arrays and a few masks), as fast as larger blocks.
_CHECK_BLOCK = 1 << 18


def _host_numpy(values: torch.Tensor) -> np.ndarray:
    return tensor_to_numpy(values.cpu())


def _is_integral(dtype: np.dtype) -> bool:
    """bool or an integer type (numpy kinds ``b``, ``i``, ``u``); the others shardstore
    supports are real floats (ml_dtypes' ones included, kind ``V``) or complex."""
    return dtype.kind in "biu"


def _integral_range(dtype: np.dtype) -> tuple[int, int]:
    return (0, 1) if dtype.kind == "b" else (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))


def _unchanged(values: np.ndarray, converted: np.ndarray) -> np.ndarray:
    """Which elements of ``converted`` hold the same number as ``values`` (see
    ``cast_checked``), both of one block. Every comparison is exact: real floats are
    compared as float64, which holds every value of every real float type; integers are
    compared in their own type, against bounds that lie in its range."""
    if values.dtype.kind == "c":
        if converted.dtype.kind == "c":
            return _unchanged(values.real, converted.real) & _unchanged(values.imag, converted.imag)
        return _unchanged(values.real, converted) & (values.imag == 0)
    if converted.dtype.kind == "c":
        return _unchanged(values, converted.real)  # the imaginary part of a converted real is 0
    if _is_integral(converted.dtype):
        low, high = _integral_range(converted.dtype)
        if not _is_integral(values.dtype):  # a whole number in range: NaN and infinities fail each test
            as_float = values.astype(np.float64)
            return (as_float >= low) & (as_float < high + 1) & (np.trunc(as_float) == as_float)
        source_low, source_high = _integral_range(values.dtype)
        ok = np.ones(values.shape, dtype=bool)
        if source_low < low:  # then low lies in the source's range, and so does high below
            ok &= values >= low
        if source_high > high:
            ok &= values <= high
        return ok
    got = converted.astype(np.float64)
    if _is_integral(values.dtype):  # back to the integer type, where the float lies in its range
        low, high = _integral_range(values.dtype)
        in_range = (got >= low) & (got < high + 1)
        return in_range & (np.where(in_range, got, 0).astype(values.dtype) == values)
    expected = values.astype(np.float64)
    return (got == expected) | (np.isnan(got) & np.isnan(expected))


def _mantissa_bits(info: torch.finfo) -> int:
    return round(-math.log2(info.eps))


class ShapedTensorSize:
    """Mixin for a description of a tensor by its ``shape`` and torch ``dtype`` (fields
    of the class using it): its bytes, before any of them is read."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize
