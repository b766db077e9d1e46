"""Every unpickling shardstore does, in one place, each admitting exact names only.

Two kinds of pickle reach shardstore:

* ``torch.save`` archives: our own ``common.pt`` and ShardedObject shards, Megatron's
  ``common.pt`` and ShardedObjects, the tensor chunks and byte items of PyTorch DCP
  ``.distcp`` files, and ``.pt`` files given to ``shardstore convert``. They are read by
  ``load_torch`` / ``load_torch_file``: ``torch.load(weights_only=True)``, torch's own
  restricted machine, with ``COMMON_STATE_GLOBALS`` added (numpy arrays, dtypes and
  scalars, ``argparse.Namespace``: what trainers keep beside their tensors) through
  ``torch.serialization.safe_globals``, which matches the exact ``module.qualname``
  of each, while any such load of the process runs. numpy's names load as stand-ins that make each dtype
  once, at its first use (numpy's own dtype could be rebuilt after an array used it).
  A global added with torch's own ``add_safe_globals`` is admitted too, and stays
  admitted after the load (numpy's own, where the process admitted them, replace the
  stand-ins).
* raw pickles: PyTorch DCP's ``.metadata`` (also inside Megatron's torch_dist
  checkpoints). torch's machine cannot read them (they use protocol 4's
  STACK_GLOBAL), so ``RestrictedUnpickler`` does, admitting ``dcp_metadata_globals()``.

An allow-list (``AllowList``) maps exact ``module.qualname`` strings to objects. A
name is looked up, never resolved: no import, no attribute walk (a dotted name such as
``torch.distributed.checkpoint.metadata`` + ``os.system`` names nothing on the list),
no module prefixes. The restricted machine also refuses what torch's refuses: calling
(REDUCE, NEWOBJ, NEWOBJ_EX, OBJ, INST) anything not on the list, BUILD on anything but
a new instance of a listed class that NEWOBJ made in this load (so no class, module or
shared object such as an enum member is ever modified), and persistent ids. EXT codes
resolve through the same lookup.

Only ``allow_unsafe_pickle=True`` (``TorchCommonLoadStrategy``), for checkpoints the
caller trusts, loads arbitrary pickles.
"""

from __future__ import annotations

__all__ = [
    "COMMON_STATE_GLOBALS", "AllowList", "InertRecord",
    "RestrictedUnpickler", "dcp_metadata_globals", "deserialize", "deserialize_dict", "load_restricted", "load_torch",
    "load_torch_file", "serialize",
]

import argparse
import copyreg
import enum
import functools
import io
import os
import pickle
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any, BinaryIO

import numpy as np
import torch

from shardstore.errors import CheckpointingException

UNSAFE_OPT_IN = "common_strategy=TorchCommonLoadStrategy(allow_unsafe_pickle=True)"


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a class or function: the name a pickle refers to it by."""
    return f"{obj.__module__}.{obj.__qualname__}"


@dataclass(frozen=True)
class AllowList:
    """The globals one kind of pickle may name: exact ``module.qualname`` -> object.

    ``classes`` are the types whose instances BUILD may fill (``__setstate__`` or their
    ``__dict__``); everything else on the list may only be called or referred to.
    """

    names: Mapping[str, Any]

    @classmethod
    def of(cls, objects: Iterable[Any], aliases: Mapping[str, Any] | None = None) -> AllowList:
        """A list of ``objects`` under their own qualified names, plus ``aliases``
        (a pickled name that loads as a stand-in object)."""
        names = {qualified_name(obj): obj for obj in objects}
        names.update(aliases or {})
        return cls(names)

    @property
    def classes(self) -> frozenset[type]:
        return frozenset(obj for obj in self.names.values() if isinstance(obj, type))

    def lookup(self, module: str, name: str) -> Any:
        try:
            return self.names[f"{module}.{name}"]
        except (KeyError, TypeError):
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: it is not on the allow-list") from None


def _numpy_functions() -> tuple[Any, Any]:
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar  # type: ignore[no-redef]
    return _reconstruct, scalar


_reconstruct, _scalar = _numpy_functions()
_OBJECT_DTYPE = type(np.dtype(object))


def _object_arrays_admitted() -> bool:
    """numpy arrays of Python objects load only where the process admitted numpy's
    object dtype class itself (``torch.serialization.add_safe_globals``)."""
    return _OBJECT_DTYPE in torch.serialization.get_safe_globals()


class _NumpyDtype:
    """Stands in, in a safe load, for a pickled ``numpy.dtype(obj, align, copy)``: it takes
    one BUILD's state and, at its first use, makes a dtype of its own that nothing in the
    file can reach. numpy's own dtype takes a BUILD at any time, so a crafted file that
    rebuilt one with object fields after an array used it made that array's bytes object
    pointers (a crash, or worse, at the next read or when the array is freed)."""

    _state: Any = None  # also for an instance NEWOBJ made, without __init__
    _made: np.dtype | None = None

    def __init__(self, obj: Any, align: bool = False, copy: bool = False) -> None:
        self._obj, self._align = obj, bool(align)

    def __setstate__(self, state: Any) -> None:
        if self._state is not None or self._made is not None:
            raise pickle.UnpicklingError("refusing to BUILD a numpy dtype twice, or after an array used it")
        self._state = state

    def made(self) -> np.dtype:
        """The dtype, made at the first call (a later BUILD is refused)."""
        if self._made is None:
            dtype = np.dtype(_with_numpy_made(self._obj), align=self._align, copy=True)
            if self._state is not None:
                dtype.__setstate__(_with_numpy_made(self._state))
            if dtype.hasobject and not _object_arrays_admitted():
                raise pickle.UnpicklingError(
                    f"Can only build numpy arrays of Python objects where their dtype class is admitted via "
                    f"add_safe_globals, but got <class '{qualified_name(_OBJECT_DTYPE)}'>"
                )
            self._made = dtype
        return self._made


class _NumpyArray:
    """Stands in, in a safe load, for ``_reconstruct(numpy.ndarray, shape, typecode)``, the
    empty array a pickled one starts as: its one BUILD makes the array, with the dtypes
    its state names made then (``_NumpyDtype``)."""

    _made: np.ndarray | None = None  # also for an instance NEWOBJ made, without __init__

    def __init__(self, subtype: Any, shape: Any, typecode: Any) -> None:
        if subtype is not _NumpyArray:  # the name numpy.ndarray loads as this class
            raise pickle.UnpicklingError(f"refusing a numpy array of {type(subtype).__name__}: only numpy.ndarray")

    def __setstate__(self, state: Any) -> None:
        if self._made is not None:
            raise pickle.UnpicklingError("refusing to BUILD a numpy array twice")
        array = _reconstruct(np.ndarray, (0,), b"b")
        array.__setstate__(_with_numpy_made(state))
        self._made = array

    def made(self) -> np.ndarray:
        """The array its BUILD made."""
        if self._made is None:
            raise pickle.UnpicklingError("a numpy array without its contents (no BUILD)")
        return self._made


def _numpy_scalar(dtype: Any, obj: Any = None) -> Any:
    """A pickled numpy scalar, made from the dtype its ``_NumpyDtype`` made."""
    made = _with_numpy_made(dtype)
    return _scalar(made) if obj is None else _scalar(made, _with_numpy_made(obj))


def _with_numpy_made(value: Any, done: dict[int, Any] | None = None) -> Any:
    """``value`` with each numpy stand-in (``_NumpyDtype``, ``_NumpyArray``) replaced by
    what it made, in every container a safe load builds (dicts, their keys too, lists,
    sets, tuples, ``argparse.Namespace``); mutable ones are changed in place, so shared
    and cyclic references stay as they were."""
    if isinstance(value, (_NumpyDtype, _NumpyArray)):
        return value.made()
    done = {} if done is None else done
    if id(value) in done:
        return done[id(value)]
    if isinstance(value, (dict, list, set, argparse.Namespace)):
        done[id(value)] = value
        if isinstance(value, dict):
            items = [(_with_numpy_made(k, done), _with_numpy_made(v, done)) for k, v in value.items()]
            value.clear()
            value.update(items)
        elif isinstance(value, list):
            value[:] = [_with_numpy_made(v, done) for v in value]
        elif isinstance(value, set):
            items = [_with_numpy_made(v, done) for v in value]
            value.clear()
            value.update(items)
        else:
            _with_numpy_made(vars(value), done)
    elif type(value) is tuple:
        done[id(value)] = value = tuple(_with_numpy_made(v, done) for v in value)
    return value


# torch.save archives: added to torch's own weights_only list. numpy's names load as the
# stand-ins above, never as numpy's own callables and classes.
_NUMPY_STAND_INS = {
    qualified_name(_reconstruct): _NumpyArray,
    qualified_name(np.ndarray): _NumpyArray,
    qualified_name(np.dtype): _NumpyDtype,
    qualified_name(_scalar): _numpy_scalar,
}
COMMON_STATE_GLOBALS = AllowList.of([argparse.Namespace], _NUMPY_STAND_INS)


def _numpys_own_globals() -> list[Any]:
    """numpy's own callables and dtype classes (not its object dtype's)."""
    dtype_classes = {type(np.dtype(t)) for t in np.sctypeDict.values() if t is not np.object_}
    return [_reconstruct, _scalar, np.ndarray, np.dtype, *sorted(dtype_classes, key=qualified_name)]


# Where the process admitted some of numpy's own names itself (Megatron-Core's
# register_safe_globals does), torch would take either object a name is admitted as:
# numpy's own are admitted then, all of them, as the process chose.
_WITH_NUMPYS_OWN = AllowList.of([argparse.Namespace, *_numpys_own_globals()])


class InertRecord:
    """Stands in for a class of the saving library that DCP metadata pickles but no
    reader needs (Megatron-Core >= 0.12 keeps its ``MCoreSavePlan`` objects in
    ``all_local_plans``): it takes the pickled attributes and has no behaviour."""


@functools.cache
def dcp_metadata_globals() -> AllowList:
    """DCP's metadata classes, as its ``.metadata`` pickles them (torch 2.4 to 2.13),
    and the few builtins they hold. Built at the first call, not at import: importing
    ``torch.distributed.checkpoint`` after ``init_process_group`` makes
    ``torch.distributed.nn.functional`` hold the default process group in its defaults,
    so ``destroy_process_group`` no longer ends its threads, and a process could abort
    at exit ("terminate called without an active exception")."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    dcp_classes = [
        metadata.Metadata,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        metadata.TensorProperties,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata._MEM_FORMAT_ENCODING,
        planner.SavePlan,
        planner.WriteItem,
        planner.WriteItemType,
        planner.TensorWriteData,
        filesystem._StorageInfo,
    ]
    builtins = [OrderedDict, set, frozenset, slice, PosixPath, PurePosixPath, WindowsPath, PureWindowsPath, Path]
    dtypes = {f"torch.{name}": value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    layouts = {"torch.serialization._get_layout": torch.serialization._get_layout, "torch.Size": torch.Size}
    inert = {"megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan": InertRecord}
    return AllowList.of([*dcp_classes, *builtins], {**dtypes, **layouts, **inert})


class RestrictedUnpickler(pickle._Unpickler):
    """A pickle machine that admits the globals of one ``AllowList`` and nothing else.

    Built on the pure-Python unpickler so that each opcode that can reach a callable,
    or change an existing object, is checked here (the C one calls BUILD on any object
    on its stack, including a class, whose attributes it would then overwrite).
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: BinaryIO, allowed: AllowList) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._callables = {id(obj) for obj in allowed.names.values() if callable(obj)}
        self._classes = allowed.classes
        # what NEWOBJ made in this load, the only objects BUILD fills (kept alive, so no id is reused)
        self._made: list[Any] = []
        self._made_ids: set[int] = set()

    def find_class(self, module: str, name: str) -> Any:
        return self._allowed.lookup(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing a persistent id: this pickle may not refer to outside objects")

    def _check_callable(self, func: Any, opcode: str) -> None:
        if id(func) not in self._callables:
            raise pickle.UnpicklingError(f"refusing {opcode} on {type(func).__name__}: not on the allow-list")

    def _load_reduce(self) -> None:
        self._check_callable(self.stack[-2], "REDUCE")
        pickle._Unpickler.load_reduce(self)

    def _load_newobj(self) -> None:
        self._check_callable(self.stack[-2], "NEWOBJ")
        pickle._Unpickler.load_newobj(self)
        self._made_here(self.stack[-1])

    def _load_newobj_ex(self) -> None:
        self._check_callable(self.stack[-3], "NEWOBJ_EX")
        pickle._Unpickler.load_newobj_ex(self)
        self._made_here(self.stack[-1])

    def _made_here(self, obj: Any) -> None:
        self._made.append(obj)
        self._made_ids.add(id(obj))

    def _instantiate(self, klass: Any, args: list[Any]) -> None:  # INST and OBJ
        self._check_callable(klass, "INST/OBJ")
        pickle._Unpickler._instantiate(self, klass, args)

    def get_extension(self, code: int) -> None:
        """EXT1/2/4: the registry's name, looked up like any global (never the
        process-wide ``copyreg._extension_cache``, which another unpickler may have filled)."""
        key = copyreg._extension_registry.get(code)
        if not key:
            raise pickle.UnpicklingError(f"refusing the unregistered extension code {code}")
        self.append(self.find_class(*key))

    def _load_build(self) -> None:
        """BUILD fills only an instance of a listed class that NEWOBJ made in this very
        load: a class, a module, or an object a constructor may hand out shared (an
        enum member, which ``WriteItemType(1)`` returns) is never changed."""
        target = self.stack[-2]
        if type(target) not in self._classes or id(target) not in self._made_ids or isinstance(target, enum.Enum):
            raise pickle.UnpicklingError(
                f"refusing BUILD on {type(target).__name__}: only new instances of listed classes may be filled"
            )
        pickle._Unpickler.load_build(self)

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _load_build


def load_restricted(data: bytes, allowed: AllowList, where: str, what: str) -> Any:
    """A raw pickle, admitting only ``allowed``; any refusal or damage is a
    ``CheckpointingException`` naming ``where`` and saying it is not valid ``what``."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), allowed).load()
    except Exception as exc:  # a malformed or hostile pickle: every failure is the file's
        raise CheckpointingException(f"{where} is not valid {what}: {type(exc).__name__}: {exc}") from exc


def _admitted_name(entry: Any) -> str:
    """The name under which an entry of torch's safe globals is admitted."""
    return entry[1] if isinstance(entry, tuple) else qualified_name(entry)


def _not_yet_admitted() -> list[Any]:
    """The globals of ``COMMON_STATE_GLOBALS`` (``_WITH_NUMPYS_OWN`` where the process
    admitted any of numpy's names itself) that the process has not admitted, as
    ``safe_globals`` takes them: torch's ``safe_globals`` removes what it added when it
    ends, so admitting one the process (or Megatron-Core's ``register_safe_globals``) had
    added would take it away."""
    admitted = {_admitted_name(entry) for entry in torch.serialization.get_safe_globals()}
    allowed = _WITH_NUMPYS_OWN if admitted & set(_NUMPY_STAND_INS) else COMMON_STATE_GLOBALS
    return [
        obj if qualified_name(obj) == name else (obj, name)
        for name, obj in allowed.names.items()
        if name not in admitted
    ]


class _Admission:
    """``COMMON_STATE_GLOBALS`` admitted while any safe load of the process runs: torch's
    ``safe_globals`` takes away, when it ends, what it added, so one load per context
    took them from a load of another thread that had begun meanwhile (and had added
    nothing, finding them admitted)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loads = 0
        self._context: Any = None

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._loads == 0:
                self._context = torch.serialization.safe_globals(_not_yet_admitted())
                self._context.__enter__()
            self._loads += 1
        try:
            yield
        finally:
            with self._lock:
                self._loads -= 1
                if self._loads == 0:
                    self._context.__exit__(None, None, None)


_ADMISSION = _Admission()


def _torch_load_errors(where: str, load: Callable[[], Any]) -> Any:
    """``load()`` (a weights_only ``torch.load``) with its failures named and explained."""
    try:
        with _ADMISSION.held():
            return _with_numpy_made(load())
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if any(phrase in text for phrase in ("weights_only", "Weights only", "Unsupported", "Can only build")):
            refused = _REFUSED_GLOBAL.search(text)
            if refused is None:  # no class named: an opcode refused, as damaged bytes make too
                raise CheckpointingException(
                    f"{where} is damaged, or holds objects a safe load refuses (unpickling could run code): "
                    f"{_torch_reason(text)}. Check it first (shardstore verify, or a copy's checksum); only if it "
                    f"is intact and you trust it, load with {UNSAFE_OPT_IN}."
                ) from exc
            name = _public_name(refused.group(1) or refused.group(2))
            raise CheckpointingException(
                f"{where} holds {name}, which a safe load refuses (unpickling could run code): "
                f"{_torch_reason(text)}. If you trust this checkpoint, admit it with "
                f"torch.serialization.add_safe_globals([{name}]) or load with {UNSAFE_OPT_IN}."
            ) from exc
        raise CheckpointingException(f"{where} is corrupt: {exc}") from exc
    except Exception as exc:  # torch's machinery on damaged bytes raises many kinds (LookupError, AssertionError)
        raise CheckpointingException(f"{where} is corrupt or truncated: {type(exc).__name__}: {exc}") from exc


# How torch names what its weights_only machine refused: a global it would not look up,
# or a class whose instance it would not build (numpy's ObjectDType of an object array).
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|but got <class '([\w.]+)'>")
# Modules whose classes pickles name by their C implementation's module, and the module
# a user imports them from (``_io.BytesIO`` is ``io.BytesIO``): the advice names what the
# user can write. A plain string map: nothing named by a file is ever imported.
_PUBLIC_MODULES = {"_io": "io"}


def _public_name(qualified: str) -> str:
    module, _, name = qualified.rpartition(".")
    return f"{_PUBLIC_MODULES[module]}.{name}" if module in _PUBLIC_MODULES else qualified


def _torch_reason(text: str) -> str:
    """The line of a weights_only error that says what was refused (torch's message
    starts with a generic, colour-coded paragraph)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in text.splitlines()]
    specific = [line for line in lines if any(word in line for word in ("Unsupported", "GLOBAL", "unsupported",
                                                                         "Can only build", "refusing"))]
    reason = (specific or [line for line in lines if line] or ["refused"])[0]
    return reason.split(". Please")[0].rstrip(".")  # our message says what to do instead


def load_torch(data: bytes, where: str) -> Any:
    """A ``torch.save`` archive held in memory, loaded safely (see the module docstring)."""
    return _torch_load_errors(where, lambda: torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))


def load_torch_file(path: str | os.PathLike, where: str | None = None) -> Any:
    """A ``torch.save`` file, memory-mapped where its format allows, loaded safely."""
    where = where or str(path)

    def load() -> Any:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):  # the legacy (non-zip) format cannot be mapped
                raise
            return torch.load(path, map_location="cpu", weights_only=True)

    return _torch_load_errors(where, load)


def serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def deserialize(data: bytes, where: str, allow_unsafe_pickle: bool) -> Any:
    """Unpickles ``data`` safely unless the caller opted in to arbitrary pickles."""
    if not allow_unsafe_pickle:
        return load_torch(data, where)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as exc:  # the caller trusts the file, but it may still be damaged
        raise CheckpointingException(f"{where} is corrupt or truncated: {type(exc).__name__}: {exc}") from exc


def deserialize_dict(data: bytes, where: str, allow_unsafe_pickle: bool) -> dict[str, Any]:
    """``deserialize`` of a common state, which must be a dict."""
    state = deserialize(data, where, allow_unsafe_pickle)
    if not isinstance(state, dict):
        raise CheckpointingException(f"{where} holds a {type(state).__name__}, expected a dict")
    return state
