"""Every call the CPU worker makes of the compiled kernels, seen: a stand-in for the
``_kernels`` module (``monkeypatch.setattr(runtime_core.workers.cpu.ops, "_kernels",
spy)`` before the stage binds: ``ops`` is the module that calls them) whose functions,
and whose step programs' recording methods, report each call to ``seen(name, args,
kwargs)`` and then make it. A program's recorded calls are made once at each of its
runs, so the calls recorded for a step are the calls it makes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime_core.workers.cpu import _kernels

Seen = Callable[[str, tuple[Any, ...], dict[str, Any]], None]


def _spied(name: str, target: Any, seen: Seen) -> Any:
    call = getattr(target, name)
    if not callable(call) or isinstance(call, type):
        return call

    def spy(*args: Any, **kw: Any) -> Any:
        seen(name, args, kw)
        return call(*args, **kw)

    return spy


class SpyProgram:
    """A ``_kernels.Program`` whose recording methods are seen (``run`` is not)."""

    def __init__(self, seen: Seen) -> None:
        self.program = _kernels.Program()
        self.seen = seen

    def run(self, positions: Any, caches: Any) -> Any:
        return self.program.run(positions, caches)

    def __getattr__(self, name: str) -> Any:
        return _spied(name, self.program, self.seen)


class KernelSpy:
    """The ``_kernels`` module with every function seen, its programs ``SpyProgram``."""

    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    def Program(self) -> SpyProgram:  # the module's name for it
        return SpyProgram(self.seen)

    def __getattr__(self, name: str) -> Any:
        return _spied(name, _kernels, self.seen)
