"""A package's public names loaded on first use: ``lazy_exports`` makes the module-level
``__getattr__`` and ``__dir__`` (PEP 562) of a package's ``__init__``, which import the
module that defines a name when the name is first asked for. Importing the package then
loads nothing else: ``python -m runtime_cupy`` imports its package before the first line
of ``__main__`` (the one that makes SIGTERM cancel the command) runs.

Each ``__init__`` lists its names three ways, checked to agree by
``tests/test_package_exports.py``: ``__all__``; the ``if TYPE_CHECKING:`` imports the
type checker reads; and, in the ``else:`` branch, ``lazy_exports(globals(), {module:
names})``, which the running code reads (there only, so that mypy takes no unknown name
of the package for ``__getattr__``'s). Standard library only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from runplan.picklable_error import PicklableError


class DuplicateExport(PicklableError, ValueError):
    """A name that two modules of one package's exports both claim."""

    def __init__(self, package: str, name: str, modules: tuple[str, str]) -> None:
        super().__init__(f"{package}: {name!r} exported from both {modules[0]} and {modules[1]}")
        self.package = package
        self.name = name
        self.modules = modules


def lazy_exports(
    namespace: MutableMapping[str, Any], exports: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is
    ``namespace``, its public names ``exports`` (a module -> the names it defines).

    A name's first lookup imports its module and keeps the value in ``namespace``, where
    later lookups find it; any other name raises ``AttributeError`` naming the package
    and the name, as Python does. ``__dir__`` is the namespace's names and the exports.
    A name that two modules claim raises ``DuplicateExport``."""
    package = str(namespace["__name__"])
    where: dict[str, str] = {}
    for module, names in exports.items():
        for name in names:
            if name in where:
                raise DuplicateExport(package, name, (where[name], module))
            where[name] = module

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}", name=name)
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(namespace.keys() | where.keys())

    return __getattr__, __dir__
