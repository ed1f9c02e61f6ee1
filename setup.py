"""Builds the CPU worker's kernels (``runtime_core.workers.cpu._kernels``: C, POSIX threads);
everything else about the package is in pyproject.toml."""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import Extension, setup

CSRC = Path("src/runtime_core/workers/cpu/csrc")

if sys.platform == "win32":
    compile_args = ["/O2", "/fp:precise"]
    link_args: list[str] = []
else:
    # -ffp-contract=off: every float expression rounds as written (no fused multiply-add
    # the compiler picks), so each instruction set computes the same bits (csrc/dot.h).
    # -g0: no debugging sections (Python's own flags ask for -g: 13 MB of the module's
    # 14; its symbols stay, for profilers; `make sanitize-address` builds with -g).
    compile_args = ["-O3", "-g0", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11", "-pthread"]
    link_args = ["-pthread"]

setup(
    ext_modules=[
        Extension(
            "runtime_core.workers.cpu._kernels",
            sources=[str(p) for p in sorted(CSRC.glob("*.c"))],
            depends=[str(p) for p in sorted(CSRC.glob("*.h"))],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
        )
    ]
)
