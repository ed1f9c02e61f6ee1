from __future__ import annotations

import pytest

from tests.fuzz.pipeline import REPORTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REPORTS:
        terminalreporter.section("GGUF fuzz")
        for tally in REPORTS:
            for line in tally.lines():
                terminalreporter.write_line(line)
