"""What the reference worker tells the planner: the defaults of ``WorkerCapabilities``
(every architecture, the 15 types, float32 weights and KV cache). The worker interface
it keeps is ``tests/runtime_core/workers/test_worker_contract.py``'s, over every worker."""

from __future__ import annotations

from runplan import WorkerCapabilities
from runplan.quant_types import QUANT_TYPES
from runtime_core.workers.interface import Worker
from runtime_core.workers.reference.worker import ReferenceWorker


def test_it_is_a_worker_with_the_reference_capabilities() -> None:
    worker: Worker = ReferenceWorker()
    assert worker.capabilities == WorkerCapabilities()
    archs = (
        "llama",
        "qwen2",
        "qwen3",
        "gemma3",
        "gemma2",
        "gemma",
        "smollm3",
        "mistral3",
        "granite",
        "exaone",
        "qwen3moe",
        "qwen2moe",
        "granitemoe",
        "phi3",
    )
    assert ReferenceWorker.capabilities.architectures == archs
    assert set(ReferenceWorker.capabilities.quant_types) == set(QUANT_TYPES)
    assert len(ReferenceWorker.capabilities.quant_types) == 15
