"""Make zarr-python read shardstore checkpoints whole without anyone importing shardstore.

Two things, each right after the zarr module it concerns has been executed:

- ``zarr.core.dtype``: register bfloat16 and float8 (``shardstore.format.zarr_dtypes``). zarr 3.1
  parses an array's ``data_type`` before it loads any entry point, and it never loads the
  ``zarr.data_type`` group at all, so the spec route (kept in ``pyproject.toml`` for zarr
  versions that honour it) is not enough.
- ``zarr.core.group``: list the arrays of those types in a checkpoint's consolidated
  metadata. shardstore keeps them out of the consolidated ``metadata`` (zarr-python
  without shardstore parses all of it when it opens a group, and a type it does not know
  would make the whole group unreadable to it) and lists them beside it, under
  ``EXTENSION_METADATA``; once the types are registered, zarr's own parser reads that part
  as if it stood in ``metadata``, so ``zarr.open_group(ckpt)["a/bf16"]`` works.

shardstore installs ``shardstore_zarr_dtypes.pth`` into site-packages; Python runs its one
line at start-up, which imports this module, which adds a one-shot import hook.

Nothing heavy happens at start-up: no numpy, no zarr, no torch (``shardstore/__init__``
is lazy). A process that never imports zarr pays for one meta-path lookup per import.
"""

from __future__ import annotations

__all__ = ["EXTENSION_METADATA", "install"]

import importlib.abc
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

# Where a checkpoint's consolidated metadata lists the arrays of extension data types
# (shardstore.format.records writes it, beside zarr's ``metadata``).
EXTENSION_METADATA = "shardstore_extension_dtype_metadata"

_DTYPES = "zarr.core.dtype"
_GROUP = "zarr.core.group"
_registered = False


def _register_shardstore_dtypes(module: ModuleType | None = None) -> None:
    global _registered
    try:
        import shardstore.format.zarr_dtypes  # noqa: F401  (registers on import)
    except ImportError as exc:
        # Never break `import zarr` for the whole environment; say why the types are missing.
        warnings.warn(
            f"shardstore could not register bfloat16/float8 with zarr ({exc}); "
            "arrays of those types will not open with plain zarr.open",
            stacklevel=2,
        )
        return
    _registered = True


def _read_extension_metadata(module: ModuleType) -> None:
    """Wraps ``ConsolidatedMetadata.from_dict`` so that it parses the documents listed
    under ``EXTENSION_METADATA`` with the others: only once our data types are registered
    (else zarr could not parse them, and the group would not open at all)."""
    consolidated = getattr(module, "ConsolidatedMetadata", None)
    parse = getattr(consolidated, "from_dict", None)
    if parse is None or getattr(parse, "_shardstore", False):
        return  # another zarr layout: plain zarr behaviour (the extension arrays unlisted)

    def from_dict(cls: type, data: dict[str, Any]) -> Any:
        extension = data.get(EXTENSION_METADATA) if isinstance(data, dict) else None
        if _registered and isinstance(extension, dict) and isinstance(data.get("metadata"), dict):
            # sorted by path: zarr nests the flat listing with itertools.groupby, which
            # needs the children of one group next to each other
            data = {**data, "metadata": dict(sorted({**data["metadata"], **extension}.items()))}
        return parse.__func__(cls, data)

    from_dict._shardstore = True  # type: ignore[attr-defined]
    consolidated.from_dict = classmethod(from_dict)


_AFTER: dict[str, Callable[[ModuleType], None]] = {
    _DTYPES: _register_shardstore_dtypes,
    _GROUP: _read_extension_metadata,
}


class _RunAfterZarrModules(importlib.abc.MetaPathFinder):
    """Wraps the loaders of the modules in ``_AFTER`` so their action runs right after
    each has been executed.

    It must see those imports before any other finder serves them. pytest puts its
    assertion-rewriting finder in front and serves every module of a package that
    registers a pytest plugin, as zarr does (``zarr.testing``): the types were then never
    registered in test processes. So on every other import this finder moves itself back
    to the front, and for a target it asks the finders behind it for the spec.
    """

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: ANN001
        if fullname not in _AFTER:
            if sys.meta_path and sys.meta_path[0] is not self:
                sys.meta_path.remove(self)
                sys.meta_path.insert(0, self)
            return None
        spec = None
        for finder in [f for f in sys.meta_path if f is not self]:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        if all(name in sys.modules or name == fullname for name in _AFTER) and self in sys.meta_path:
            sys.meta_path.remove(self)  # the last target: nothing left to watch
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RunningLoader(spec.loader, _AFTER[fullname])  # a wrapper: the loader may serve other modules
        return spec


class _RunningLoader(importlib.abc.Loader):
    """Runs the real loader, then the action for its module."""

    def __init__(self, inner: importlib.abc.Loader, action: Callable[[ModuleType], None]) -> None:
        self.inner = inner
        self.action = action

    def create_module(self, spec):  # noqa: ANN001, ANN201
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.action(module)


def install() -> None:
    """Act now on the zarr modules already imported, and on the others when they are."""
    for name, action in _AFTER.items():
        if name in sys.modules:
            action(sys.modules[name])
    pending = [name for name in _AFTER if name not in sys.modules]
    if pending and not any(isinstance(f, _RunAfterZarrModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _RunAfterZarrModules())


install()
