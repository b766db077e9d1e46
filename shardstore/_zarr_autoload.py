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
import importlib.machinery
import sys
import warnings
from types import ModuleType

_TARGET = "zarr.core.dtype"


class _RegisterAfterZarrDtype(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``zarr.core.dtype`` so our types register right after it runs."""

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: ANN001
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _register_shardstore_dtypes()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


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
