"""Checks of the clauses about the plan itself: formation, layer and edge assignment,
authority. Each yields what breaks its clause (the first is reported); each reads the
plan afresh rather than trusting ``check_plan``, so the two are independent readings
of the contract."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator

from runplan.contract.subject import Subject
from runplan.placement import Placement, PlacementStrategy
from runplan.plan import (
    EdgeEndpoint,
    EdgeKind,
    OrchestratorEndpoint,
    RunPlan,
    StageEndpoint,
    StagePlan,
)
from runplan.validate import id_problem
from runplan.wire import WireError, dumps, loads

Check = Callable[[Subject], Iterator[str]]


def describe(e: EdgeEndpoint) -> str:
    if isinstance(e, OrchestratorEndpoint):
        return f"orchestrator {e.node_id!r}"
    return f"stage {e.stage_index} on {e.node_id!r}"


def end(s: StagePlan) -> StageEndpoint:
    return StageEndpoint(s.node_id, s.stage_index)


def short(values: list[int], limit: int = 8) -> str:
    text = ", ".join(map(str, values[:limit]))
    return f"[{text}{', ...' if len(values) > limit else ''}]"


# -- RunPlan Formation ----------------------------------------------------------------


def one_plan_or_rejection(s: Subject) -> Iterator[str]:
    """Over a plan: it is the plan of its inputs (when given: its config's settings, the
    stages its placement puts on each node); run-wide settings that
    ``check_plan`` rejects (the chain's settings among them) are reported here (the
    planner should have rejected)."""
    yield from _chain_settings(s)
    if s.inputs is None:
        return
    c, p = s.inputs.config, s.plan
    for name, planned, configured in (
        ("run_id", p.run_id, c.run_id),
        ("max_tokens", p.max_tokens, c.max_tokens),
        ("timeouts", p.timeouts, c.timeouts),
        ("sampling", p.sampling, c.sampling),
        ("return_logits", p.return_logits, c.return_logits),
    ):
        if planned != configured:
            yield f"the plan's {name} is {planned!r}; the config says {configured!r}"
    yield from _placement_kept(s.inputs.placement, s.inputs.facts.num_layers, p)


def _placement_kept(placement: Placement, num_layers: int, p: RunPlan) -> Iterator[str]:
    """The plan's stages are where its placement puts them (a planner that swapped two
    nodes, or moved a cut, passed every clause)."""
    stages = {st.stage_index: st for st in p.stages}
    if placement.strategy is PlacementStrategy.EXPLICIT:
        yield from _explicit_rows(placement, stages)
    elif placement.strategy is PlacementStrategy.EVEN:
        yield from _even_stages(placement, num_layers, stages)
    else:
        yield from _listed_nodes(placement, p)


def _explicit_rows(placement: Placement, stages: dict[int, StagePlan]) -> Iterator[str]:
    """An explicit placement is the plan's stages, row for row: each stage on the node
    and over the blocks its assignment names."""
    for row in placement.assignments:
        st = stages.get(row.stage_index)
        if st is None:
            continue  # a missing stage: its own clause
        planned = (st.node_id, st.layer_start, st.layer_end_exclusive)
        asked = (row.node_id, row.layer_start, row.layer_end_exclusive)
        if planned != asked:
            yield (
                f"stage {row.stage_index} is on {planned[0]!r} over blocks "
                f"[{planned[1]}, {planned[2]}); the placement assigns it {asked[0]!r} over "
                f"[{asked[1]}, {asked[2]})"
            )


def _even_stages(
    placement: Placement, num_layers: int, stages: dict[int, StagePlan]
) -> Iterator[str]:
    """An even placement puts stage ``i`` on ``nodes[i]`` and gives the first
    ``num_layers % len(nodes)`` stages one block more than the others."""
    n = len(placement.nodes)
    base, extra = divmod(num_layers, max(n, 1))
    start = 0
    for i, node_id in enumerate(placement.nodes):
        end = start + base + (1 if i < extra else 0)
        st = stages.get(i)
        if st is not None and st.node_id != node_id:
            yield (
                f"stage {i} is on {st.node_id!r}; the even placement of nodes "
                f"{placement.nodes!r} puts it on {node_id!r}"
            )
        if st is not None and (st.layer_start, st.layer_end_exclusive) != (start, end):
            yield (
                f"stage {i} is over blocks [{st.layer_start}, {st.layer_end_exclusive}); "
                f"the even placement of {num_layers} blocks on {n} nodes gives it "
                f"[{start}, {end})"
            )
        start = end


def _listed_nodes(placement: Placement, p: RunPlan) -> Iterator[str]:
    """A by-memory placement puts every stage on a node it lists, in the order the
    planner chooses (a service may put its biggest node first: the example service of
    docs/contract-ci.md does)."""
    listed = set(placement.nodes)
    for st in p.stages:
        if st.node_id not in listed:
            yield (
                f"stage {st.stage_index} is on {st.node_id!r}, a node the by-memory "
                f"placement of nodes {placement.nodes!r} does not list"
            )


def _chain_settings(s: Subject) -> Iterator[str]:
    """The run-wide settings of a run on a chain (CONCURRENT_RUNS.md §3-§5), read from
    the spec: the run reserves between 1 and ``max_seq_len`` positions, every stage's
    cache for them fits that stage's KV budget, a batch holds at least one row and a
    prefill chunk fits one batch."""
    p = s.plan
    if not 1 <= p.kv_positions <= p.model.max_seq_len:
        yield (
            f"the run reserves {p.kv_positions} KV positions, outside "
            f"1..max_seq_len ({p.model.max_seq_len})"
        )
    if p.max_tokens > p.kv_positions:
        yield (
            f"the run reserves {p.kv_positions} KV positions; a prompt of at least 1 token "
            f"and max_tokens {p.max_tokens} need {p.max_tokens}"
        )
    ids = [("the orchestrator's node id", p.orchestrator_node_id)]
    ids += [(f"stage {st.stage_index}'s node id", st.node_id) for st in p.stages]
    for what, node_id in ids:
        problem = id_problem(node_id)
        if problem:
            yield f"{what} {node_id!r} {problem}"
    for stage in p.stages:
        if not 0 <= stage.kv_bytes <= stage.kv_budget_bytes:
            yield (
                f"stage {stage.stage_index}'s KV cache of {stage.kv_bytes} bytes does not fit "
                f"its budget of {stage.kv_budget_bytes} bytes"
            )
    if p.max_batch_rows < 1:
        yield f"a batch of {p.max_batch_rows} rows holds no step"
    if not 1 <= p.prefill_chunk <= max(p.max_batch_rows, 1):
        yield (
            f"prefill chunks of {p.prefill_chunk} rows, "
            f"outside 1..max_batch_rows ({p.max_batch_rows})"
        )


def never_partial(s: Subject) -> Iterator[str]:
    p = s.plan
    n = len(p.stages)
    if n == 0:
        yield "the plan has no stages"
    elif len(p.edges) != n + 1:
        yield (
            f"{n} stages need {n + 1} edges (token-in, {n - 1} activation, token-out); "
            f"the plan has {len(p.edges)}"
        )
    for i, stage in enumerate(p.stages):
        for side, edge_id in (("inbound", stage.inbound_edge), ("outbound", stage.outbound_edge)):
            if edge_id not in s.edges:
                yield f"stage {i} names {side} edge {edge_id}, which the plan lacks"
    strays = [(f"stage {x.stage_index}", x.run_id) for x in p.stages]
    strays += [(f"edge {e.edge_id}", e.run_id) for e in p.edges]
    for what, run_id in strays:
        if run_id != p.run_id:
            yield f"{what} belongs to run {run_id!r}, not the plan's {p.run_id!r}"
    if s.inputs is not None and n != s.inputs.stage_count:
        yield f"the plan has {n} stages; {s.inputs.stage_count} were asked for"


def no_hidden_topology(s: Subject) -> Iterator[str]:
    p = s.plan
    ends = {end(st) for st in p.stages}
    orch = OrchestratorEndpoint(p.orchestrator_node_id)
    used = {st.inbound_edge for st in p.stages} | {st.outbound_edge for st in p.stages}
    for e in p.edges:
        for side, x in (("producer", e.producer), ("consumer", e.consumer)):
            if x != orch and x not in ends:
                yield (
                    f"edge {e.edge_id}'s {side} is {describe(x)}, neither a stage of the "
                    f"plan nor its orchestrator {p.orchestrator_node_id!r}"
                )
        if e.edge_id not in used:
            yield (
                f"edge {e.edge_id} ({describe(e.producer)} -> {describe(e.consumer)}) "
                "is used by no stage"
            )
    if s.inputs is not None and p.orchestrator_node_id != s.inputs.pool.orchestrator_node_id:
        yield (
            f"the plan's orchestrator is {p.orchestrator_node_id!r}; the pool's is "
            f"{s.inputs.pool.orchestrator_node_id!r}"
        )


# -- Layer Assignment -----------------------------------------------------------------


def contiguous(s: Subject) -> Iterator[str]:
    stages = s.plan.stages
    for a, b in itertools.pairwise(stages):
        if a.layer_end_exclusive != b.layer_start:
            yield (
                f"stage {a.stage_index} ends at layer {a.layer_end_exclusive} but stage "
                f"{b.stage_index} starts at layer {b.layer_start}"
            )


def no_overlap(s: Subject) -> Iterator[str]:
    ranges = sorted(
        (st.layer_start, st.layer_end_exclusive, st.stage_index)
        for st in s.plan.stages
        if st.layer_start < st.layer_end_exclusive
    )
    if not ranges:
        return
    widest = ranges[0]
    for r in ranges[1:]:
        if r[0] < widest[1]:
            yield (
                f"stages {widest[2]} and {r[2]} both hold layers [{r[0]}, {min(r[1], widest[1])})"
            )
        if r[1] > widest[1]:
            widest = r


def union_covers(s: Subject) -> Iterator[str]:
    num_layers = s.plan.model.num_layers
    if s.inputs is not None and num_layers != s.inputs.facts.num_layers:
        yield (
            f"the plan's model has {num_layers} layers; the model facts say "
            f"{s.inputs.facts.num_layers}"
        )
    covered = 0  # every layer below this is in some stage
    for start, stop in sorted((st.layer_start, st.layer_end_exclusive) for st in s.plan.stages):
        if start > covered and covered < num_layers:
            yield f"layers [{covered}, {min(start, num_layers)}) are in no stage's range"
        covered = max(covered, stop)
    if covered < num_layers:
        yield f"layers [{covered}, {num_layers}) are in no stage's range"


def non_empty(s: Subject) -> Iterator[str]:
    num_layers = s.plan.model.num_layers
    for st in s.plan.stages:
        a, b = st.layer_start, st.layer_end_exclusive
        if b <= a:
            yield f"stage {st.stage_index} has the empty range [{a}, {b})"
        elif a < 0 or b > num_layers:
            yield f"stage {st.stage_index}'s range [{a}, {b}) is outside blocks 0..{num_layers}"


def indices(s: Subject) -> Iterator[str]:
    got = [st.stage_index for st in s.plan.stages]
    n = len(got)
    if got != list(range(n)):
        yield f"the stages' indices are {short(got)}, not 0..{n - 1} in order"
    for st in s.plan.stages:
        if st.stage_count != n:
            yield f"stage {st.stage_index} says stage_count {st.stage_count}; the plan has {n}"
    if s.inputs is not None and n != s.inputs.stage_count:
        yield f"the plan has {n} stages; stage_count {s.inputs.stage_count} was asked for"


# -- Edge Assignment ------------------------------------------------------------------


def unique_edge_ids(s: Subject) -> Iterator[str]:
    for edge_id, count in Counter(e.edge_id for e in s.plan.edges).items():
        if count > 1:
            yield f"edge id {edge_id} is used by {count} edges"


def one_producer_one_consumer(s: Subject) -> Iterator[str]:
    p = s.plan
    for e in p.edges:
        if e.producer == e.consumer:
            yield f"edge {e.edge_id} runs from {describe(e.producer)} to itself"
    produced = Counter(e.producer for e in p.edges)
    consumed = Counter(e.consumer for e in p.edges)
    parties: list[EdgeEndpoint] = [OrchestratorEndpoint(p.orchestrator_node_id)]
    parties += [end(st) for st in p.stages]
    for x in parties:
        for verb, counts in (("produces", produced), ("consumes", consumed)):
            if counts[x] != 1:
                yield f"{describe(x)} {verb} {counts[x]} edges, not exactly one"


def _single(s: Subject, kind: EdgeKind, what: str) -> Iterator[str]:
    found = [e for e in s.plan.edges if e.kind is kind]
    if len(found) != 1:
        yield f"the plan has {len(found)} {what} edges, not one"


def _endpoints(
    s: Subject, edge_id: int, kind: EdgeKind, producer: EdgeEndpoint, consumer: EdgeEndpoint
) -> Iterator[str]:
    e = s.edges.get(edge_id)
    if e is None:
        yield f"edge {edge_id} is not in the plan"
        return
    if e.kind is not kind:
        yield f"edge {edge_id} is {e.kind.value}, not {kind.value}"
    for side, want, got in (("producer", producer, e.producer), ("consumer", consumer, e.consumer)):
        if got != want:
            yield f"edge {edge_id}'s {side} is {describe(got)}, not {describe(want)}"


def token_in(s: Subject) -> Iterator[str]:
    p = s.plan
    yield from _single(s, EdgeKind.TOKEN_IN, "token-in")
    if p.stages:
        orch = OrchestratorEndpoint(p.orchestrator_node_id)
        first = p.stages[0]
        yield from _endpoints(s, first.inbound_edge, EdgeKind.TOKEN_IN, orch, end(first))


def activation(s: Subject) -> Iterator[str]:
    p = s.plan
    n = len(p.stages)
    count = sum(e.kind is EdgeKind.ACTIVATION for e in p.edges)
    if n and count != n - 1:
        yield f"the plan has {count} activation edges; {n} stages need {n - 1}"
    for a, b in zip(p.stages, p.stages[1:], strict=False):
        if a.outbound_edge != b.inbound_edge:
            yield (
                f"stage {a.stage_index} sends on edge {a.outbound_edge} but stage "
                f"{b.stage_index} receives on edge {b.inbound_edge}"
            )
        yield from _endpoints(s, a.outbound_edge, EdgeKind.ACTIVATION, end(a), end(b))


def token_out(s: Subject) -> Iterator[str]:
    p = s.plan
    yield from _single(s, EdgeKind.TOKEN_OUT, "token-out")
    if p.stages:
        orch = OrchestratorEndpoint(p.orchestrator_node_id)
        last = p.stages[-1]
        yield from _endpoints(s, last.outbound_edge, EdgeKind.TOKEN_OUT, end(last), orch)


def edge_ids_handed(s: Subject) -> Iterator[str]:
    """A stage is handed its edge ids: its provision names the plan's edges it
    consumes and produces, so there is nothing for it to derive."""
    for q in s.provisions:
        stage = s.stages.get(q.stage_index)
        if stage is None:
            continue  # reported by the provisioning clauses
        for side, handed, planned in (
            ("inbound", q.inbound.edge_id, stage.inbound_edge),
            ("outbound", q.outbound.edge_id, stage.outbound_edge),
        ):
            if handed != planned:
                yield (
                    f"stage {q.stage_index} is handed {side} edge {handed}; the plan gives "
                    f"it edge {planned}"
                )
        me = end(stage)
        inbound, outbound = s.edges.get(q.inbound.edge_id), s.edges.get(q.outbound.edge_id)
        if inbound is not None and inbound.consumer != me:
            yield f"stage {q.stage_index}'s inbound edge {inbound.edge_id} is consumed by another"
        if outbound is not None and outbound.producer != me:
            yield f"stage {q.stage_index}'s outbound edge {outbound.edge_id} is produced by another"


# -- Authority / Rejection ------------------------------------------------------------


def known_nodes(s: Subject) -> Iterator[str]:
    pool = s.need_inputs("its node pool").pool
    ids = {n.node_id for n in pool.nodes}
    for st in s.plan.stages:
        if st.node_id not in ids:
            yield f"stage {st.stage_index} runs on {st.node_id!r}, which is not in the node pool"


def no_duplicate_assignment(s: Subject) -> Iterator[str]:
    p = s.plan
    for index, count in Counter(st.stage_index for st in p.stages).items():
        if count > 1:
            yield f"stage index {index} is assigned {count} times"
    hosts: dict[str, int] = {}
    for st in p.stages:
        if st.node_id == p.orchestrator_node_id:
            yield f"stage {st.stage_index} runs on the orchestrator's node {st.node_id!r}"
        elif st.node_id in hosts:
            yield f"node {st.node_id!r} hosts stages {hosts[st.node_id]} and {st.stage_index}"
        hosts.setdefault(st.node_id, st.stage_index)


def no_missing_stage(s: Subject) -> Iterator[str]:
    n = len(s.plan.stages)
    present = set(s.stages)
    for i in range(n):
        if i not in present:
            yield f"stage index {i} of 0..{n - 1} has no stage"


def valid_stage_count(s: Subject) -> Iterator[str]:
    n, num_layers = len(s.plan.stages), s.plan.model.num_layers
    if n < 1:
        yield "a plan needs at least one stage"
    if n > num_layers:
        yield f"{n} stages for {num_layers} layers"
    for st in s.plan.stages:
        if st.stage_count != n:
            yield f"stage {st.stage_index} says stage_count {st.stage_count}; the plan has {n}"
    provisions = s.given if s.given is not None else s.derived or ()
    for q in provisions:
        if q.stage_count != n:
            yield f"the provision of stage {q.stage_index} says stage_count {q.stage_count}"
    if s.inputs is not None and n != s.inputs.stage_count:
        yield f"the plan has {n} stages; stage_count {s.inputs.stage_count} was asked for"


def named_endpoints(s: Subject) -> Iterator[str]:
    p = s.plan
    if not p.stages:
        return
    orch = OrchestratorEndpoint(p.orchestrator_node_id)
    ends = [end(st) for st in p.stages]
    Row = tuple[EdgeKind, EdgeEndpoint, EdgeEndpoint]
    wanted: Counter[Row] = Counter(
        [
            (EdgeKind.TOKEN_IN, orch, ends[0]),
            *((EdgeKind.ACTIVATION, a, b) for a, b in itertools.pairwise(ends)),
            (EdgeKind.TOKEN_OUT, ends[-1], orch),
        ]
    )
    actual: Counter[Row] = Counter((e.kind, e.producer, e.consumer) for e in p.edges)
    for kind, producer, consumer in wanted - actual:
        yield f"no {kind.value} edge {describe(producer)} -> {describe(consumer)}"
    for kind, producer, consumer in actual - wanted:
        yield (
            f"a {kind.value} edge runs {describe(producer)} -> {describe(consumer)}, "
            "which the contract does not name"
        )


def consistent_facts(s: Subject) -> Iterator[str]:
    m = s.plan.model
    for name in ("num_layers", "hidden_dim", "vocab_size", "max_seq_len"):
        if getattr(m, name) < 1:
            yield f"the model's {name} is {getattr(m, name)}"
    if not 0 <= m.eos_token_id < m.vocab_size:
        yield f"eos token {m.eos_token_id} is outside the vocabulary 0..{m.vocab_size - 1}"
    for token in m.eog_token_ids:
        if not 0 <= token < m.vocab_size:
            yield f"end token {token} is outside the vocabulary 0..{m.vocab_size - 1}"
    if len(set(m.eog_token_ids)) != len(m.eog_token_ids):
        yield f"end tokens {list(m.eog_token_ids)} repeat an id"
    if len(s.plan.stages) > m.num_layers >= 1:
        yield f"{len(s.plan.stages)} stages for a model of {m.num_layers} layers"
    if not m.gguf_source.paths or not all(m.gguf_source.paths):
        yield f"the model's GGUF source {m.gguf_source.paths!r} names no file"
    for path in m.gguf_source.paths:
        problem = id_problem(path) if path else None
        if problem:
            yield f"the model's GGUF path {path!r} {problem}"
    for st in s.plan.stages:
        if st.gguf_source != m.gguf_source:
            yield f"stage {st.stage_index} loads {st.gguf_source}, not the model's {m.gguf_source}"
    if s.inputs is None:
        return
    f = s.inputs.facts
    for name in (
        "model_id",
        "gguf_source",
        "architecture",
        "num_layers",
        "hidden_dim",
        "max_seq_len",
        "eos_token_id",
        "eog_token_ids",
        "vocab_size",
    ):
        if getattr(m, name) != getattr(f, name):
            planned, read = getattr(m, name), getattr(f, name)
            yield f"the plan's model {name} is {planned!r}; the facts say {read!r}"


def only_source(s: Subject) -> Iterator[str]:
    """Stages are provisioned from the plan alone: the plan as it travels yields the
    very provisions the stages get."""
    try:
        travelled = loads(dumps(s.plan))
    except WireError as exc:
        yield f"the plan does not survive the wire: {exc}"
        return
    if travelled != s.plan:
        yield "the plan read back off the wire differs from the plan"
    if s.given is not None and s.derived is not None and s.given != s.derived:
        yield "the provisions given are not the ones derived from the plan"
