"""runtime_cupy: the real runtime. One OS process per stage (``python -m
runtime_cupy.stage``), the orchestrator in the launching process, edges as
shared-memory rings, authenticated control channels, clean teardown on any fault.

``generate(...)`` has ``runtime_sim.generate``'s signature and result fields, plus
runtime options (``worker="cpu" | "numpy" | "cuda"``, ``gpus``, ``timeouts``, ``log_dir``).
The CUDA worker (``runtime_cupy.worker``) is imported only when asked for.
"""

from runtime_core.runs import PlanRejected
from runtime_cupy.api import GenerateResult, generate
from runtime_cupy.launcher import ProcessRun, ProcessRunResult, StageProcessInfo
from runtime_cupy.workers import WorkerUnavailable

__all__ = [
    "GenerateResult",
    "PlanRejected",
    "ProcessRun",
    "ProcessRunResult",
    "StageProcessInfo",
    "WorkerUnavailable",
    "generate",
]
