"""runtime_sim: a deterministic simulator of a pipeline run.

It runs a whole plan (orchestrator and every stage) in one thread on a virtual clock,
with the same state machines, controllers and workers as the real runtime; injects
faults from a seed; and checks every guarantee over the trace. ``generate`` runs a
real GGUF model through N simulated stages.
"""

from runtime_core.runs import PlanRejected
from runtime_sim.api import GenerateResult, generate

__all__ = ["GenerateResult", "PlanRejected", "generate"]
