"""The README's "Use the contract in your CI" example service
(``docs/examples/contract_ci``): its own contract tests, written with
``runplan.testing``, pass against its planner."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "contract_ci"


def _load(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    spec = importlib.util.spec_from_file_location(f"contract_ci_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_services_contract_tests_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    tests = _load(monkeypatch, "test_service_contract")
    names = [n for n in dir(tests) if n.startswith("test_")]
    assert len(names) == 2
    for name in names:  # at the example's own settings (no deadline), the profile's count
        getattr(tests, name)()
