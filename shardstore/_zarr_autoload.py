"""Make zarr-python know shardstore's data types without anyone importing shardstore.

zarr 3.1 parses an array's ``data_type`` before it loads any entry point, and it never
loads the ``zarr.data_type`` group at all, so the spec route (kept in ``pyproject.toml``
for zarr versions that honour it) is not enough. shardstore therefore installs
``shardstore_zarr_dtypes.pth`` into site-packages; Python runs its one line at start-up,
which imports this module. It adds a one-shot import hook: when ``zarr.core.dtype`` has
been executed, ``shardstore.zarr_dtypes`` is imported and registers bfloat16 and float8.

Nothing heavy happens at start-up: no numpy, no zarr, no torch (``shardstore/__init__``
is lazy). A process that never imports zarr pays for one meta-path lookup per import.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from types import ModuleType

_TARGET = "zarr.core.dtype"


class _RegisterAfterZarrDtype(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``zarr.core.dtype`` so our types register right after it runs.

    It must see that import before any other finder serves it. pytest puts its
    assertion-rewriting finder in front and serves every module of a package that
    registers a pytest plugin, as zarr does (``zarr.testing``): the types were then never
    registered in test processes. So on every other import this finder moves itself back
    to the front, and for the target it asks the finders behind it for the spec.
    """

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: ANN001
        if fullname != _TARGET:
            if sys.meta_path and sys.meta_path[0] is not self:
                sys.meta_path.remove(self)
                sys.meta_path.insert(0, self)
            return None
        sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisteringLoader(spec.loader)  # a wrapper: the loader may serve other modules
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader, then registers shardstore's data types."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):  # noqa: ANN001, ANN201
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _register_shardstore_dtypes()


def _register_shardstore_dtypes() -> None:
    try:
        import shardstore.zarr_dtypes  # noqa: F401  (registers on import)
    except ImportError as exc:
        # Never break `import zarr` for the whole environment; say why the types are missing.
        warnings.warn(
            f"shardstore could not register bfloat16/float8 with zarr ({exc}); "
            "arrays of those types will not open with plain zarr.open",
            stacklevel=2,
        )


def install() -> None:
    """Register now if zarr is already imported, else when it is."""
    if _TARGET in sys.modules:
        _register_shardstore_dtypes()
    elif not any(isinstance(f, _RegisterAfterZarrDtype) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterZarrDtype())


install()
