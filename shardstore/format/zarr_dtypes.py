"""zarr-python data types for bfloat16 and float8, the Zarr v3 names TensorStore writes.

zarr-python 3.1 knows none of these types; TensorStore writes and reads them natively
under the names ``bfloat16``, ``float8_e4m3fn`` and ``float8_e5m2``. The classes below
teach zarr-python the same names. They are registered through the ``zarr.data_type``
entry-point group in shardstore's ``pyproject.toml``, so an installed shardstore makes a
plain ``zarr.open`` read such arrays without importing shardstore.

zarr 3.1 collects ``zarr.data_type`` entry points but never loads them (its registry's
``_lazy_load`` has no caller), and it parses ``data_type`` before it flushes any other
registry. ``shardstore/_zarr_autoload.py`` (run from a ``.pth`` file) therefore imports
this module as soon as ``zarr.core.dtype`` is imported. Importing it registers the types
below; the registration is idempotent, so a zarr that fixes its loader changes nothing.
The same hook then lets zarr list a checkpoint's arrays of these types, which its
consolidated metadata keeps apart so that zarr-python without shardstore still opens the
rest (``shardstore.format.records``).

This module is loaded by zarr itself, so it must stay light: numpy, ml_dtypes and zarr
only (``shardstore/__init__`` imports its submodules lazily for the same reason).
"""

from __future__ import annotations

__all__ = ["BFloat16", "Float8E4M3FN", "Float8E5M2", "ML_DTYPES"]

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeGuard

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import DataTypeValidationError, DTypeJSON, HasItemSize
from zarr.core.dtype.npy.common import (
    check_json_float_v3,
    check_json_floatish_str,
    endianness_to_numpy_str,
    float_from_json_v3,
    float_to_json_v3,
)
from zarr.core.dtype.npy.float import BaseFloat
from zarr.core.dtype.wrapper import ZDType


class _MLFloatMixin:
    """Behaviour shared by the ml_dtypes float types: JSON names, scalars, native dtype."""

    _zarr_v3_name: ClassVar[str]
    _scalar_type: ClassVar[type]

    @classmethod
    def _check_json_v2(cls, data: DTypeJSON) -> TypeGuard[Any]:
        # Zarr v2 has no name for these types; shardstore only writes Zarr v3.
        return False

    @classmethod
    def _from_json_v2(cls, data: DTypeJSON) -> Any:
        raise DataTypeValidationError(f"{cls._zarr_v3_name} has no Zarr v2 representation")

    @classmethod
    def _check_json_v3(cls, data: DTypeJSON) -> TypeGuard[str]:
        return data == cls._zarr_v3_name

    @classmethod
    def _from_json_v3(cls, data: DTypeJSON) -> Any:
        if cls._check_json_v3(data):
            return cls()
        raise DataTypeValidationError(
            f"Invalid JSON representation of {cls.__name__}: {data!r}, expected {cls._zarr_v3_name!r}"
        )

    def to_json(self, zarr_format: Literal[2, 3]) -> Any:
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(f"{self._zarr_v3_name} is only defined for Zarr v3, not v{zarr_format}")

    def to_native_dtype(self) -> np.dtype:
        # One byte: no byte order (``BFloat16`` gives its own).
        return np.dtype(self._scalar_type)

    def _check_scalar(self, data: object) -> bool:
        return isinstance(data, (int, float, np.floating, np.integer, self._scalar_type))

    def _cast_scalar_unchecked(self, data: Any) -> Any:
        return self._scalar_type(data)

    def cast_scalar(self, data: object) -> Any:
        if self._check_scalar(data):
            return self._cast_scalar_unchecked(data)
        raise TypeError(f"Cannot convert {data!r} to a {self._zarr_v3_name} scalar")

    def default_scalar(self) -> Any:
        return self._scalar_type(0)

    def from_json_scalar(self, data: Any, *, zarr_format: Literal[2, 3]) -> Any:
        if isinstance(data, str) and data.startswith("0x"):
            return self._from_hex(data)
        if check_json_float_v3(data):
            return self._cast_scalar_unchecked(float_from_json_v3(data))
        if check_json_floatish_str(data):
            return self._cast_scalar_unchecked(float(data))
        raise TypeError(f"Invalid {self._zarr_v3_name} fill value: {data!r}")

    def _from_hex(self, data: str) -> Any:
        """A fill value given as its bits, ``0x`` and the big-endian bytes in hex (Zarr v3
        float fill values, as TensorStore reads them): two digits per byte of this type.
        zarr's own decoder sizes the bits by the digits, so it read bfloat16 ``0x3f80``
        (1.0) as the float16 bits 1.875, and refused float8's two digits."""
        size = np.dtype(self._scalar_type).itemsize
        digits = data[2:]
        if not re.fullmatch(f"[0-9a-fA-F]{{{2 * size}}}", digits):
            raise TypeError(
                f"Invalid {self._zarr_v3_name} fill value: {data!r}; a hex fill value is '0x' and {2 * size} hex digits"
            )
        return np.array(int(digits, 16), dtype=f"u{size}").view(self._scalar_type)[()]

    def to_json_scalar(self, data: object, *, zarr_format: Literal[2, 3]) -> Any:
        return float_to_json_v3(float(self.cast_scalar(data)))


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MLFloatMixin, BaseFloat):  # type: ignore[misc]
    """bfloat16: two bytes, so it has an endianness like float16."""

    dtype_cls = type(np.dtype(ml_dtypes.bfloat16))
    _zarr_v3_name: ClassVar[str] = "bfloat16"
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()
    _scalar_type: ClassVar[type] = ml_dtypes.bfloat16

    @property
    def item_size(self) -> int:
        return 2

    def to_native_dtype(self) -> np.dtype:
        """bfloat16 in the byte order of ``endianness``, which zarr's ``bytes`` codec
        sets from the array's ``endian`` before it views a chunk's bytes as this type:
        in host order always, a big-endian array read as byte-swapped garbage."""
        return np.dtype(self._scalar_type).newbyteorder(endianness_to_numpy_str(self.endianness))


@dataclass(frozen=True, kw_only=True)
class _Float8(_MLFloatMixin, ZDType, HasItemSize):  # type: ignore[misc]
    """A one-byte float: no endianness, so the bytes codec carries no ``endian``."""

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> _Float8:
        if cls._check_native_dtype(dtype):
            return cls()
        raise DataTypeValidationError(f"Invalid data type {dtype}, expected {cls._zarr_v3_name}")

    @property
    def item_size(self) -> int:
        return 1


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_Float8):
    dtype_cls = type(np.dtype(ml_dtypes.float8_e4m3fn))
    _zarr_v3_name: ClassVar[str] = "float8_e4m3fn"
    _scalar_type: ClassVar[type] = ml_dtypes.float8_e4m3fn


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_Float8):
    dtype_cls = type(np.dtype(ml_dtypes.float8_e5m2))
    _zarr_v3_name: ClassVar[str] = "float8_e5m2"
    _scalar_type: ClassVar[type] = ml_dtypes.float8_e5m2


ML_DTYPES: tuple[type[ZDType], ...] = (BFloat16, Float8E4M3FN, Float8E5M2)

for _zdtype in ML_DTYPES:
    data_type_registry.register(_zdtype._zarr_v3_name, _zdtype)
