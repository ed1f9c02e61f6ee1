"""runtime_sim: a deterministic simulator of a chain of pipeline runs.

It runs a whole chain (orchestrator and every stage, one run or several in flight) in
one thread on a virtual clock, with the same state machines, chain controllers and
workers as the real runtime; injects faults from a seed; and checks every guarantee
over the trace. ``generate`` runs a real GGUF model through N simulated stages,
``generate_runs`` several runs of one prompt through one chain.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime_core.runs import PlanRejected
    from runtime_sim.api import ConcurrentResult, GenerateResult, generate, generate_runs
else:  # each name's module imported on first use (runplan.lazy_exports)
    from runplan.lazy_exports import lazy_exports as _lazy_exports

    __getattr__, __dir__ = _lazy_exports(
        globals(),
        {
            "runtime_core.runs": ["PlanRejected"],
            "runtime_sim.api": ["ConcurrentResult", "GenerateResult", "generate", "generate_runs"],
        },
    )
    del _lazy_exports  # no name of the package (and runplan.lazy_exports stays the module)

__all__ = ["ConcurrentResult", "GenerateResult", "PlanRejected", "generate", "generate_runs"]
