"""A local host whose stage processes can import this repository's ``tests`` package:
the test hosts whose stages run a module under ``tests.support`` derive from it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from runtime_cupy.hosts.local import LocalProcessHost
from runtime_cupy.hosts.port import StageLaunch

ROOT = Path(__file__).resolve().parents[2]


class RepoTreeHost(LocalProcessHost):
    """``LocalProcessHost`` with the repository's root ahead of the package's path."""

    def environment(
        self, launch: StageLaunch, inherited: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        env = super().environment(launch, inherited)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env["PYTHONPATH"]])
        return env
