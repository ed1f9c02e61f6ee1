"""Checks of the clauses about provisioning: the ``ProvisionStage`` messages given
(or, when none are given, derived with ``provision_all``) against the plan."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from typing import Any

import attrs

from runplan.contract.plan_clauses import end
from runplan.contract.subject import Subject
from runplan.messages import ProvisionStage
from runplan.provision import provision_stage


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where two values of one attrs class first differ, as ``field.sub: a != b``."""
    if type(a) is type(b) and attrs.has(type(a)):
        for f in attrs.fields(type(a)):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if x != y:
                return _first_difference(x, y, f"{path}.{f.name}" if path else f.name)
    return f"{path or 'value'}: {a!r} != {b!r}"


def deterministic(s: Subject) -> Iterator[str]:
    if s.derived is None:
        yield f"ProvisionStage cannot be derived from this plan: {s.derive_error}"
        return
    again = provision_stage_all(s)
    if again != s.derived:
        yield "deriving the provisions twice gave different messages"
    if s.given is None:
        return
    if len(s.given) != len(s.derived):
        yield f"{len(s.given)} provisions for a plan of {len(s.derived)} stages"
    for given, derived in zip(s.given, s.derived, strict=False):
        if given != derived:
            yield (
                f"the provision given as stage {given.stage_index}'s differs from the one "
                f"the plan derives: {_first_difference(given, derived)}"
            )


def provision_stage_all(s: Subject) -> tuple[ProvisionStage, ...]:
    """Each stage's provision, one at a time, from a copy of the plan."""
    plan = copy.deepcopy(s.plan)
    return tuple(provision_stage(plan, i) for i in range(len(plan.stages)))


def own_layer_range(s: Subject) -> Iterator[str]:
    for q in s.provisions:
        stage = s.stages.get(q.stage_index)
        if stage is None:
            yield f"a provision is for stage {q.stage_index}, which the plan lacks"
            continue
        got = (q.layer_start, q.layer_end_exclusive)
        own = (stage.layer_start, stage.layer_end_exclusive)
        if got != own:
            yield (
                f"stage {q.stage_index} receives layers [{got[0]}, {got[1]}); its own range "
                f"is [{own[0]}, {own[1]})"
            )


def one_inbound_one_outbound(s: Subject) -> Iterator[str]:
    counts = Counter(q.stage_index for q in s.provisions)
    for i in s.stages:
        if counts[i] != 1:
            yield f"stage {i} receives {counts[i]} provisions, not one"
    for q in s.provisions:
        if q.inbound.edge_id == q.outbound.edge_id:
            yield f"stage {q.stage_index} receives edge {q.inbound.edge_id} as inbound and outbound"
        stage = s.stages.get(q.stage_index)
        if stage is None:
            continue
        if q.inbound.edge_id != stage.inbound_edge:
            yield (
                f"stage {q.stage_index} receives inbound edge {q.inbound.edge_id}; it consumes "
                f"edge {stage.inbound_edge}"
            )
        if q.outbound.edge_id != stage.outbound_edge:
            yield (
                f"stage {q.stage_index} receives outbound edge {q.outbound.edge_id}; it "
                f"produces edge {stage.outbound_edge}"
            )


def outbound_consumer(s: Subject) -> Iterator[str]:
    for q in s.provisions:
        e = s.edges.get(q.outbound.edge_id)
        if e is None:
            yield f"stage {q.stage_index}'s outbound edge {q.outbound.edge_id} is not in the plan"
        elif q.outbound.consumer_node_id != e.consumer.node_id:
            yield (
                f"stage {q.stage_index}'s outbound provision names consumer "
                f"{q.outbound.consumer_node_id!r}; edge {e.edge_id}'s consumer is "
                f"{e.consumer.node_id!r}"
            )


def _strings(value: Any) -> set[str]:
    """Every string anywhere inside a value class."""
    if isinstance(value, str):
        return {value}
    if attrs.has(type(value)):
        return set().union(*(_strings(getattr(value, f.name)) for f in attrs.fields(type(value))))
    if isinstance(value, tuple | list):
        return set().union(set(), *(_strings(v) for v in value))
    return set()


def inbound_needs_no_producer(s: Subject) -> Iterator[str]:
    """The stage sets its inbound end up locally from the edge id and specs: the
    inbound provision names the edge the stage consumes and no producer."""
    for q in s.provisions:
        e = s.edges.get(q.inbound.edge_id)
        stage = s.stages.get(q.stage_index)
        if e is None:
            yield f"stage {q.stage_index}'s inbound edge {q.inbound.edge_id} is not in the plan"
            continue
        if stage is not None and e.consumer != end(stage):
            yield f"stage {q.stage_index}'s inbound edge {e.edge_id} is consumed by another"
        producer = e.producer.node_id
        if producer != q.node_id and producer in _strings(q.inbound):
            yield f"stage {q.stage_index}'s inbound provision names its producer {producer!r}"


def no_remote_addresses(s: Subject) -> Iterator[str]:
    """A provision names two nodes, by node id: its own and its consumer's."""
    p = s.plan
    nodes = {st.node_id for st in p.stages} | {p.orchestrator_node_id}
    if s.inputs is not None:
        nodes |= {n.node_id for n in s.inputs.pool.nodes}
    for q in s.provisions:
        stage = s.stages.get(q.stage_index)
        if stage is not None and q.node_id != stage.node_id:
            yield (
                f"the provision of stage {q.stage_index} is for node {q.node_id!r}; the stage "
                f"runs on {stage.node_id!r}"
            )
        consumer = q.outbound.consumer_node_id
        if consumer not in nodes:
            yield (
                f"stage {q.stage_index}'s outbound provision names {consumer!r}, which is no "
                "node of the plan (a node id, never an address)"
            )
        # Strings outside the run's and model's names: none may name another node.
        named = set()
        for f in attrs.fields(ProvisionStage):
            if f.name not in ("run_id", "gguf_source", "model"):
                named |= _strings(getattr(q, f.name))
        for other in sorted((named & nodes) - {q.node_id, consumer}):
            yield f"the provision of stage {q.stage_index} names node {other!r}"
