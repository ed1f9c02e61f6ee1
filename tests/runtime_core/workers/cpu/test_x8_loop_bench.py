"""benchmarks/cpu_x8_loop.py's program still builds against the kernels and runs them.

It links the instruction sets' files and calls their tables as ops.c does: a change to
a table's fields or to an entry's signature breaks it here, not in a later session's
measurement. No timing is asserted: only that each pass ran and printed its time."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from benchmarks import cpu_x8_loop

ROOT = Path(__file__).resolve().parents[4]

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("x8_loop")
    return cpu_x8_loop.build(ROOT / cpu_x8_loop.CSRC, out, opt="-O1")  # a quicker build


@pytest.mark.parametrize("isa", cpu_x8_loop.ISAS)
def test_the_loop_times_every_type_and_row_count(loop: Path, isa: str) -> None:
    if not cpu_x8_loop.runs_here(isa):
        pytest.skip(f"this processor does not run {isa}")
    for qtype in cpu_x8_loop.TYPES:
        for rows in (1, 2, 5, 33):  # decode's kernels; a tile; more rows than a tile
            ms, _ = cpu_x8_loop.run(loop, isa, qtype, (32, 512), rows, 2)
            assert ms > 0
