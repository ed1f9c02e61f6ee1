"""runtime_core: what every runtime shares.

Loading one stage's slice of a GGUF file, the tokenizer, the NumPy reference worker,
sampling, the ring and its edge ends, and the controllers that drive the orchestrator
and stage state machines of ``runplan.fsm`` for the runs of one chain
(``ChainStageController``, ``ChainOrchestrator``, over the chain's links and the
workers' batched steps; a single request is a chain with one run).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime_core.chain_orchestrator import ChainOrchestrator, RunRefused
    from runtime_core.chain_stage import ChainStageController
    from runtime_core.edge_ends import EdgeFaultError, ReceiveEnd, Record, SendEnd
    from runtime_core.errors import UnsupportedModel
    from runtime_core.gguf_slice import StageSlice, open_stage_slice
    from runtime_core.links import LinkReceiver, LinkSender, LocalLinks
    from runtime_core.model_config import ModelConfig
    from runtime_core.ring import EdgeClosed, EdgeTimeout, Ring, RingError
    from runtime_core.tokenizer import (
        ChatTemplateError,
        NoChatTemplate,
        Tokenizer,
        TokenizerError,
        UnknownPreTokenizer,
        UnknownTokenizerModel,
    )
    from runtime_core.workers.interface import (
        BatchStep,
        KvCacheUnavailable,
        StepFailure,
        StepWorker,
        TokenOutput,
        Worker,
        WorkerError,
    )
    from runtime_core.workers.reference.worker import ReferenceWorker
    from runtime_core.workers.sampling import Sampler
else:  # each name's module imported on first use (runplan.lazy_exports)
    from runplan.lazy_exports import lazy_exports as _lazy_exports

    __getattr__, __dir__ = _lazy_exports(
        globals(),
        {
            "runtime_core.chain_orchestrator": ["ChainOrchestrator", "RunRefused"],
            "runtime_core.chain_stage": ["ChainStageController"],
            "runtime_core.edge_ends": ["EdgeFaultError", "ReceiveEnd", "Record", "SendEnd"],
            "runtime_core.errors": ["UnsupportedModel"],
            "runtime_core.gguf_slice": ["StageSlice", "open_stage_slice"],
            "runtime_core.links": ["LinkReceiver", "LinkSender", "LocalLinks"],
            "runtime_core.model_config": ["ModelConfig"],
            "runtime_core.ring": ["EdgeClosed", "EdgeTimeout", "Ring", "RingError"],
            "runtime_core.tokenizer": [
                "ChatTemplateError",
                "NoChatTemplate",
                "Tokenizer",
                "TokenizerError",
                "UnknownPreTokenizer",
                "UnknownTokenizerModel",
            ],
            "runtime_core.workers.interface": [
                "BatchStep",
                "KvCacheUnavailable",
                "StepFailure",
                "StepWorker",
                "TokenOutput",
                "Worker",
                "WorkerError",
            ],
            "runtime_core.workers.reference.worker": ["ReferenceWorker"],
            "runtime_core.workers.sampling": ["Sampler"],
        },
    )
    del _lazy_exports  # no name of the package (and runplan.lazy_exports stays the module)

__all__ = [
    "BatchStep",
    "ChainOrchestrator",
    "ChainStageController",
    "ChatTemplateError",
    "EdgeClosed",
    "EdgeFaultError",
    "EdgeTimeout",
    "KvCacheUnavailable",
    "LinkReceiver",
    "LinkSender",
    "LocalLinks",
    "ModelConfig",
    "NoChatTemplate",
    "ReceiveEnd",
    "Record",
    "ReferenceWorker",
    "Ring",
    "RingError",
    "RunRefused",
    "Sampler",
    "SendEnd",
    "StageSlice",
    "StepFailure",
    "StepWorker",
    "TokenOutput",
    "Tokenizer",
    "TokenizerError",
    "UnknownPreTokenizer",
    "UnknownTokenizerModel",
    "UnsupportedModel",
    "Worker",
    "WorkerError",
    "open_stage_slice",
]
