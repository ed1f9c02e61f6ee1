"""runtime_sim: a deterministic simulator of a chain of pipeline runs.

It runs a whole chain (orchestrator and every stage, one run or several in flight) in
one thread on a virtual clock, with the same state machines, chain controllers and
workers as the real runtime; injects faults from a seed; and checks every guarantee
over the trace. ``generate`` runs a real GGUF model through N simulated stages,
``generate_runs`` several runs of one prompt through one chain.
"""

from runtime_core.runs import PlanRejected
from runtime_sim.api import ConcurrentResult, GenerateResult, generate, generate_runs

__all__ = ["ConcurrentResult", "GenerateResult", "PlanRejected", "generate", "generate_runs"]
