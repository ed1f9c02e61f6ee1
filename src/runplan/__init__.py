"""runplan: the pure planning library of gguf-pipeline.

Model facts (read from a GGUF header) + node pool + runtime config + placement ->
one immutable ``RunPlan`` or a typed ``PlanRejection``, then one ``ProvisionStage``
per stage. See ARCHITECTURE.md for the public API.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runplan.check import check_plan
    from runplan.config import RuntimeConfig, SamplingConfig, Timeouts, WorkerCapabilities
    from runplan.dtypes import DTypeFamily
    from runplan.facts import GgufSource, ModelFacts
    from runplan.gguf_error import GgufError
    from runplan.gguf_facts import model_facts_from_gguf
    from runplan.messages import (
        InboundEdgeProvision,
        OutboundEdgeProvision,
        ProvisionStage,
        StageModelFacts,
    )
    from runplan.placement import Placement, PlacementStrategy, StageAssignment
    from runplan.plan import (
        EdgeKind,
        EdgePlan,
        GgufModelPlan,
        Layout,
        ObjectKind,
        ObjectSpec,
        OrchestratorEndpoint,
        RingSpec,
        RunPlan,
        StageEndpoint,
        StagePlan,
    )
    from runplan.planner import plan_run
    from runplan.pool import NodePool, NodeSpec
    from runplan.provision import provision_all, provision_stage
    from runplan.rejections import PlanRejection
else:  # each name's module imported on first use (runplan.lazy_exports)
    from runplan.lazy_exports import lazy_exports as _lazy_exports

    __getattr__, __dir__ = _lazy_exports(
        globals(),
        {
            "runplan.check": ["check_plan"],
            "runplan.config": ["RuntimeConfig", "SamplingConfig", "Timeouts", "WorkerCapabilities"],
            "runplan.dtypes": ["DTypeFamily"],
            "runplan.facts": ["GgufSource", "ModelFacts"],
            "runplan.gguf_error": ["GgufError"],
            "runplan.gguf_facts": ["model_facts_from_gguf"],
            "runplan.messages": [
                "InboundEdgeProvision",
                "OutboundEdgeProvision",
                "ProvisionStage",
                "StageModelFacts",
            ],
            "runplan.placement": ["Placement", "PlacementStrategy", "StageAssignment"],
            "runplan.plan": [
                "EdgeKind",
                "EdgePlan",
                "GgufModelPlan",
                "Layout",
                "ObjectKind",
                "ObjectSpec",
                "OrchestratorEndpoint",
                "RingSpec",
                "RunPlan",
                "StageEndpoint",
                "StagePlan",
            ],
            "runplan.planner": ["plan_run"],
            "runplan.pool": ["NodePool", "NodeSpec"],
            "runplan.provision": ["provision_all", "provision_stage"],
            "runplan.rejections": ["PlanRejection"],
        },
    )
    del _lazy_exports  # no name of the package (and runplan.lazy_exports stays the module)

__all__ = [
    "DTypeFamily",
    "EdgeKind",
    "EdgePlan",
    "GgufError",
    "GgufModelPlan",
    "GgufSource",
    "InboundEdgeProvision",
    "Layout",
    "ModelFacts",
    "NodePool",
    "NodeSpec",
    "ObjectKind",
    "ObjectSpec",
    "OrchestratorEndpoint",
    "OutboundEdgeProvision",
    "Placement",
    "PlacementStrategy",
    "PlanRejection",
    "ProvisionStage",
    "RingSpec",
    "RunPlan",
    "RuntimeConfig",
    "SamplingConfig",
    "StageAssignment",
    "StageEndpoint",
    "StageModelFacts",
    "StagePlan",
    "Timeouts",
    "WorkerCapabilities",
    "check_plan",
    "model_facts_from_gguf",
    "plan_run",
    "provision_all",
    "provision_stage",
]
