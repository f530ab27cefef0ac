"""Lazy package exports: a package names what it offers and from which submodule, and each name's
submodule is imported only when the name is first used (keeps ``import notebookkit.data`` light).

Used in a package ``__init__``, each submodule with the names it offers::

    __getattr__, __dir__, __all__ = lazy_package(__name__, {
        "chat_templates": ("get_chat_template", "list_chat_templates"),
        "packing": ("pack_examples",),
    })
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Iterable, Mapping, Optional


def lazy_exports(
    package: str, table: dict[str, str], not_provided: Optional[dict[str, str]] = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module-level ``__getattr__`` and ``__dir__`` for ``package`` (PEP 562).

    ``table`` maps each exported name to the submodule of ``package`` that defines it
    (``"packing"`` for ``package + ".packing"``); the attribute of that name is returned from it.
    ``not_provided`` maps names other notebook APIs export, and ``package`` does not, to what to
    use instead: asking for one raises ``notebookkit._porting.NotProvidedError`` with that text.
    """

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(f"{package}.{table[name]}"), name)
        if not_provided and name in not_provided:
            from notebookkit._porting import not_provided as error

            raise error(package, name, not_provided)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(list(vars(sys.modules[package])) + list(table))

    return __getattr__, __dir__


def lazy_package(
    package: str, offers: Mapping[str, Iterable[str]], more: Optional[Mapping[str, str]] = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` of ``package``, which offers the names ``offers[sub]`` from its
    submodule ``sub`` (and each name of ``more`` from the submodule it maps to), imported on first use."""
    table = {name: sub for sub, names in offers.items() for name in names}
    table.update(more or {})
    return (*lazy_exports(package, table), list(table))
