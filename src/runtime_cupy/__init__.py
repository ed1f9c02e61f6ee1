"""runtime_cupy: the real runtime. The orchestrator in the launching process, each stage
where a host puts it (``hosts``: by default one OS process per stage, ``python -m
runtime_cupy.process.stage_process``), edges through shared memory or TCP (``edges``), authenticated
control channels (``control``), clean teardown on any fault.

``generate(...)`` has ``runtime_sim.generate``'s signature and result fields, plus
runtime options (``worker="cpu" | "numpy" | "cuda"``, ``gpus``, ``timeouts``, ``log_dir``,
``edges="auto" | "shm" | "tcp"``, ``host``; ``handle_signals``: SIGINT / SIGTERM cancel
the run, the command line's; by default Ctrl-C tears it down and reaches the caller).
``generate_batch(model, prompts, ...)``
runs many prompts on one chain, up to ``max_concurrent`` in flight at once (by default
as many as the hosts' memory holds, at most 64), and yields each result as it completes.
The CUDA worker (``runtime_cupy.cuda.worker``) is imported only when asked for, and
each of these names' modules on first use (``runplan.lazy_exports``): importing the
package, as ``python -m runtime_cupy`` does before its ``__main__``, loads no runtime.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime_core.runs import PlanRejected
    from runtime_cupy.api import GenerateResult, generate
    from runtime_cupy.batch import generate_batch
    from runtime_cupy.hosts.local import LocalProcessHost
    from runtime_cupy.hosts.port import StageHost, StageProcessInfo
    from runtime_cupy.process.launcher import ProcessRun, ProcessRunResult
    from runtime_cupy.workers import WorkerUnavailable
else:  # each name's module imported on first use (runplan.lazy_exports)
    from runplan.lazy_exports import lazy_exports as _lazy_exports

    __getattr__, __dir__ = _lazy_exports(
        globals(),
        {
            "runtime_core.runs": ["PlanRejected"],
            "runtime_cupy.api": ["GenerateResult", "generate"],
            "runtime_cupy.batch": ["generate_batch"],
            "runtime_cupy.hosts.local": ["LocalProcessHost"],
            "runtime_cupy.hosts.port": ["StageHost", "StageProcessInfo"],
            "runtime_cupy.process.launcher": ["ProcessRun", "ProcessRunResult"],
            "runtime_cupy.workers": ["WorkerUnavailable"],
        },
    )
    del _lazy_exports  # no name of the package (and runplan.lazy_exports stays the module)

__all__ = [
    "GenerateResult",
    "LocalProcessHost",
    "PlanRejected",
    "ProcessRun",
    "ProcessRunResult",
    "StageHost",
    "StageProcessInfo",
    "WorkerUnavailable",
    "generate",
    "generate_batch",
]
