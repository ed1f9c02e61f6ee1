"""runplan: the pure planning library of gguf-pipeline.

Model facts (read from a GGUF header) + node pool + runtime config + placement ->
one immutable ``RunPlan`` or a typed ``PlanRejection``, then one ``ProvisionStage``
per stage. See ARCHITECTURE.md for the public API.
"""

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
