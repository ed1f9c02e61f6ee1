"""benchmarks/cpu_x8_loop.py's program still builds against the kernels and runs them.

It includes csrc/x8_kernels.h as the instruction sets' files do: a change to an entry's
signature or to the header's definitions breaks it here, not in a later session's
measurement. No timing is asserted: only that a pass ran and printed its time."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from benchmarks import cpu_x8_loop

ROOT = Path(__file__).resolve().parents[4]

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_the_loop_builds_and_times_a_pass(tmp_path: Path, qtype: str, isa: str) -> None:
    missing = [f for f in cpu_x8_loop.ISAS[isa][3] if f not in cpu_x8_loop.cpu_flags()]
    if missing:
        pytest.skip(f"this processor lacks {', '.join(missing)}")
    exe = cpu_x8_loop.build(ROOT / cpu_x8_loop.CSRC, qtype, isa, tmp_path)
    for rows in (1, 5):  # a decode step's products; a K-quant's tile above X8_XT
        ms = cpu_x8_loop.run(exe, (16, 512), rows, 2)
        assert ms > 0
