"""A script's output with NumPy's own vector code on and off: NumPy runs code of its own
for AVX2 and AVX-512 where the processor has them (``np.exp``, ``np.cos``, ...), whose
last bits differ from its baseline's; ``NPY_DISABLE_CPU_FEATURES`` turns it off, so a
test on this machine sees what a processor without them computes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: NumPy's vector code for processors newer than x86-64-v2 turned off: its baseline.
BASELINE = "X86_V3 X86_V4 AVX512_ICL AVX512_SPR"


def environment(baseline: bool) -> dict[str, str]:
    """This process's environment, NumPy's vector code off (``baseline``) or as found."""
    env = {k: v for k, v in os.environ.items() if k != "NPY_DISABLE_CPU_FEATURES"}
    return dict(env, NPY_DISABLE_CPU_FEATURES=BASELINE) if baseline else env


def script_words(script: str, baseline: bool) -> list[str]:
    """The words ``python -c script`` prints, NumPy's vector code off or on; skips the
    test where NumPy does not start with it off."""
    out = subprocess.run(
        [sys.executable, "-c", script], env=environment(baseline), capture_output=True,
        text=True, timeout=120, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        pytest.skip(f"NumPy did not start with NPY_DISABLE_CPU_FEATURES: {out.stderr[-300:]}")
    return out.stdout.split()
