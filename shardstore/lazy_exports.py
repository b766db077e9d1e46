"""A package's public names, imported from its modules on first use (PEP 562).

A layer's package (``shardstore.format``, ``shardstore.protocol``, ...) is the one entry
that the layers above import from: its ``__all__`` lists what they may use, and
``lazy_exports`` gives it the module ``__getattr__`` and ``__dir__`` that import each
name from the module that defines it when it is first asked for, so that importing the
package imports nothing else. That matters: the zarr start-up hook
(``shardstore._zarr_autoload``, run from a ``.pth`` file at every interpreter start)
imports ``shardstore.format``'s data types, and an eager ``__init__`` would pull torch in
with them, or close an import cycle between a package and its own modules.

A name's value is the defining module's attribute itself (``is`` holds), looked up there
at each use and never copied into the package, so that the package always answers what
the module holds now, as an import from the module would. A name must not also be a
module of the package: importing that module would put it in the name's place.
"""

from __future__ import annotations

__all__ = ["lazy_exports"]

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(
    package: str, by_module: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose public names are those of
    ``by_module`` (a module of the package, relative: ``"records"`` -> the names it
    defines that the package offers)."""
    home = {name: f"{package}.{module}" for module, names in by_module.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(home))

    return __getattr__, __dir__
