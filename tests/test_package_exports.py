"""The packages' public names (``runplan.lazy_exports``): each ``__init__`` imports none
of its modules, yet every name of its ``__all__`` is there as before (``from runtime_cupy
import generate``, ``runtime_cupy.generate``, ``dir(runtime_cupy)``), the very object its
defining module holds; the three lists of an ``__init__`` (``__all__``, the ``if
TYPE_CHECKING:`` imports mypy reads, the ``lazy_exports`` map the running code reads)
agree; and a name that is not there raises ``AttributeError`` naming it."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runplan.lazy_exports import DuplicateExport, lazy_exports

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["runplan", "runtime_core", "runtime_cupy", "runtime_sim"]


def _init(package: str) -> ast.Module:
    path = ROOT / "src" / package / "__init__.py"
    return ast.parse(path.read_text(), str(path))


def _typed_imports(package: str) -> dict[str, str]:
    """Name -> module, from the ``if TYPE_CHECKING:`` block of the package's ``__init__``."""
    found: dict[str, str] = {}
    for node in _init(package).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom), ast.unparse(statement)
                assert statement.module is not None
                found.update({alias.name: statement.module for alias in statement.names})
    return found


def _lazy_map(package: str) -> dict[str, str]:
    """Name -> module, from the ``lazy_exports(globals(), {...})`` call of the ``__init__``."""
    calls = [
        node
        for node in ast.walk(_init(package))
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) in ("lazy_exports", "_lazy_exports")
    ]
    assert len(calls) == 1, package
    exports: dict[str, list[str]] = ast.literal_eval(calls[0].args[1])
    return {name: module for module, names in exports.items() for name in names}


@pytest.mark.parametrize("package", PACKAGES)
def test_the_three_lists_of_an_init_agree(package: str) -> None:
    module = importlib.import_module(package)
    typed = _typed_imports(package)
    assert typed, package
    assert _lazy_map(package) == typed
    assert sorted(module.__all__) == sorted(typed)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_its_defining_modules_object(package: str) -> None:
    module = importlib.import_module(package)
    for name, defining in _typed_imports(package).items():
        held = getattr(importlib.import_module(defining), name)
        assert getattr(module, name) is held, (package, name)
        namespace: dict[str, object] = {}
        exec(f"from {package} import {name}", namespace)
        assert namespace[name] is held, (package, name)
    assert set(module.__all__) <= set(dir(module))


@pytest.mark.parametrize("package", PACKAGES)
def test_a_name_the_package_lacks_is_an_attribute_error_naming_it(package: str) -> None:
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match=f"^module '{package}' has no attribute 'nothing'$"):
        _ = module.nothing
    with pytest.raises(ImportError, match="cannot import name 'nothing'"):
        exec(f"from {package} import nothing", {})


# A fresh interpreter: import the package, print the project's modules then loaded, ask
# for one public name, print again.
_LOADED = """
import importlib, sys

def ours():
    tops = ("runplan", "runtime_core", "runtime_cupy", "runtime_sim", "numpy", "attrs", "gguf")
    return sorted(m for m in sys.modules if m.split(".")[0] in tops)

package = importlib.import_module(sys.argv[1])
print(" ".join(ours()))
getattr(package, sys.argv[2])
print(" ".join(ours()))
"""


@pytest.mark.parametrize(
    ("package", "name", "defining"),
    [
        ("runplan", "RunPlan", "runplan.plan"),
        ("runtime_core", "Tokenizer", "runtime_core.tokenizer"),
        ("runtime_cupy", "generate", "runtime_cupy.api"),
        ("runtime_sim", "generate", "runtime_sim.api"),
    ],
)
def test_importing_a_package_loads_none_of_its_modules_until_a_name_is_asked_for(
    package: str, name: str, defining: str
) -> None:
    """What ``python -m PACKAGE`` imports before the first line of its ``__main__`` (the
    SIGTERM handler's): the package and ``runplan.lazy_exports`` (with the mixin of its
    error, ``runplan.picklable_error``), no runtime, no NumPy."""
    done = subprocess.run(
        [sys.executable, "-c", _LOADED, package, name],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=60,
        check=True,
    )
    before, after = (line.split() for line in done.stdout.splitlines())
    assert before == sorted({package, "runplan", "runplan.lazy_exports", "runplan.picklable_error"})
    assert defining in after


def test_a_name_two_modules_claim_is_refused_naming_both() -> None:
    with pytest.raises(DuplicateExport, match=r"^pkg: 'x' exported from both pkg\.a and pkg\.b$"):
        lazy_exports({"__name__": "pkg"}, {"pkg.a": ["x"], "pkg.b": ["y", "x"]})


def test_a_name_is_imported_once_then_held_by_the_package() -> None:
    namespace: dict[str, object] = {"__name__": "pkg"}
    getattr_, dir_ = lazy_exports(namespace, {"json": ["dumps"]})
    assert dir_() == ["__name__", "dumps"]
    dumps = getattr_("dumps")
    assert dumps is sys.modules["json"].dumps
    assert namespace["dumps"] is dumps


def test_no_package_keeps_the_helper_as_a_name() -> None:
    """``runplan.lazy_exports`` is the module (an ``__init__`` that imported the function
    under its own name made the package's attribute the function), and no package keeps
    the helper among its names."""
    code = (
        "import runplan, runtime_core, runtime_cupy, runtime_sim, runplan.lazy_exports as m\n"
        "kept = [p.__name__ for p in (runplan, runtime_core, runtime_cupy, runtime_sim)\n"
        "        if '_lazy_exports' in vars(p)]\n"
        "print(type(m).__name__, type(runplan.lazy_exports).__name__, kept)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "module module []", done.stdout
