"""Checks of the Object/Ring Spec Consistency clauses, computed from the contract's
formulas (EDGES_AND_WORKERS.md §1-§2) rather than from the planner's helpers."""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from runplan.contract.subject import Subject
from runplan.dtypes import VALID_WIDTHS, DTypeFamily
from runplan.memory import kv_width
from runplan.messages import StageModelFacts
from runplan.plan import (
    OBJECT_HEADER_BYTES,
    U64_MAX,
    EdgeKind,
    EdgePlan,
    Layout,
    ObjectKind,
    ObjectSpec,
    RingSpec,
)

TOKEN_ID_BYTES = 4
LOGIT_BYTES = 4

#: What each edge kind carries: object kind and the layouts it may have.
CARRIES: dict[EdgeKind, tuple[ObjectKind, frozenset[Layout]]] = {
    EdgeKind.TOKEN_IN: (ObjectKind.TOKEN, frozenset({Layout.TOKEN_IDS})),
    EdgeKind.ACTIVATION: (ObjectKind.ACTIVATION, frozenset({Layout.ROW_MAJOR})),
    EdgeKind.TOKEN_OUT: (
        ObjectKind.TOKEN,
        frozenset({Layout.TOKEN_IDS, Layout.TOKEN_ID_WITH_LOGITS}),
    ),
}


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def object_and_ring_specs(s: Subject) -> Iterator[str]:
    for e in s.plan.edges:
        spec, ring = e.object_spec, e.ring_spec
        if not isinstance(spec, ObjectSpec) or not isinstance(ring, RingSpec):
            yield f"edge {e.edge_id} lacks an ObjectSpec or a RingSpec"
            continue
        if ring.slot_count < 1:
            yield f"edge {e.edge_id}'s ring has {ring.slot_count} slots"
        if _power_of_two(ring.alignment):
            need = OBJECT_HEADER_BYTES + spec.max_extent
            slot = -(-need // ring.alignment) * ring.alignment
            if ring.slot_bytes != slot:
                yield (
                    f"edge {e.edge_id}'s ring slots are {ring.slot_bytes} bytes; the "
                    f"{OBJECT_HEADER_BYTES}-byte header and max_extent {spec.max_extent}, "
                    f"aligned to {ring.alignment}, take {slot}"
                )
        if s.inputs is not None:
            c = s.inputs.config
            if (ring.slot_count, ring.alignment) != (c.ring_slot_count, c.ring_alignment):
                yield (
                    f"edge {e.edge_id}'s ring has {ring.slot_count} slots aligned to "
                    f"{ring.alignment}; the config says {c.ring_slot_count} aligned to "
                    f"{c.ring_alignment}"
                )


def activation_extent(s: Subject) -> Iterator[str]:
    m = s.plan.model
    want = m.max_seq_len * m.hidden_dim * m.dtype_width_bytes
    for e in s.plan.edges:
        if e.kind is not EdgeKind.ACTIVATION:
            continue
        spec = e.object_spec
        if spec.max_extent != want:
            yield (
                f"activation edge {e.edge_id}'s max_extent is {spec.max_extent}; "
                f"{m.max_seq_len} * {m.hidden_dim} * {m.dtype_width_bytes} = {want}"
            )
        if (spec.dtype_family, spec.dtype_width_bytes) != (m.dtype_family, m.dtype_width_bytes):
            yield (
                f"activation edge {e.edge_id} carries {spec.dtype_family.value}/"
                f"{spec.dtype_width_bytes}; the model plan's dtype is {m.dtype_family.value}/"
                f"{m.dtype_width_bytes}"
            )
    if s.inputs is None:
        return
    f, c = s.inputs.facts, s.inputs.config
    planned = (m.max_seq_len, m.hidden_dim, m.dtype_family, m.dtype_width_bytes)
    wanted = (
        f.max_seq_len,
        f.hidden_dim,
        c.activation_dtype_family,
        c.activation_dtype_width_bytes,
    )
    if planned != wanted:
        yield (
            f"the model plan's (max_seq_len, hidden_dim, dtype) is {_show(planned)}; the "
            f"facts and config say {_show(wanted)}"
        )


def _show(values: tuple[object, ...]) -> str:
    return "(" + ", ".join(v.value if isinstance(v, DTypeFamily) else str(v) for v in values) + ")"


def _token_spec(e: EdgePlan, max_seq_len: int, vocab: int, logits: bool) -> tuple[Layout, int]:
    if e.kind is EdgeKind.TOKEN_IN:
        return Layout.TOKEN_IDS, max_seq_len * TOKEN_ID_BYTES
    if logits:
        return Layout.TOKEN_ID_WITH_LOGITS, TOKEN_ID_BYTES + LOGIT_BYTES * vocab
    return Layout.TOKEN_IDS, TOKEN_ID_BYTES


def token_and_activation_specs(s: Subject) -> Iterator[str]:
    p, m = s.plan, s.plan.model
    for e in p.edges:
        spec = e.object_spec
        if e.kind is EdgeKind.ACTIVATION:
            if (spec.kind, spec.layout) != (ObjectKind.ACTIVATION, Layout.ROW_MAJOR):
                yield (
                    f"activation edge {e.edge_id} carries {spec.kind.value}/{spec.layout.value} "
                    "objects, not ACTIVATION/ROW_MAJOR"
                )
            continue
        layout, extent = _token_spec(e, m.max_seq_len, m.vocab_size, p.return_logits)
        got = (spec.kind, spec.layout, spec.dtype_family, spec.dtype_width_bytes, spec.max_extent)
        want = (ObjectKind.TOKEN, layout, DTypeFamily.UINT, TOKEN_ID_BYTES, extent)
        if got != want:
            yield (
                f"{e.kind.value} edge {e.edge_id}'s spec is {_spec(got)}; a token spec here is "
                f"{_spec(want)}"
            )
    if s.inputs is not None:
        f, c = s.inputs.facts, s.inputs.config
        if (m.vocab_size, p.return_logits) != (f.vocab_size, c.return_logits):
            yield (
                f"the plan has vocab {m.vocab_size}, return_logits {p.return_logits}; the facts "
                f"and config say {f.vocab_size}, {c.return_logits}"
            )


def _spec(t: tuple[ObjectKind, Layout, DTypeFamily, int, int]) -> str:
    return f"{t[0].value}/{t[1].value}/{t[2].value}/{t[3]} of {t[4]} bytes"


def copied_into_provisions(s: Subject) -> Iterator[str]:
    m = s.plan.model
    for q in s.provisions:
        for side, end in (("inbound", q.inbound), ("outbound", q.outbound)):
            e = s.edges.get(end.edge_id)
            if e is None:
                yield f"stage {q.stage_index}'s {side} edge {end.edge_id} is not in the plan"
                continue
            for name in ("kind", "object_spec", "ring_spec"):
                if getattr(end, name) != getattr(e, name):
                    yield (
                        f"stage {q.stage_index}'s {side} {name} is {getattr(end, name)!r}; "
                        f"edge {e.edge_id}'s is {getattr(e, name)!r}"
                    )
        for f in attrs.fields(StageModelFacts):
            given, planned = getattr(q.model, f.name), getattr(m, f.name)
            if given != planned:
                yield (
                    f"stage {q.stage_index}'s model {f.name} is {given!r}; the plan's is "
                    f"{planned!r}"
                )
        if q.gguf_source != m.gguf_source:
            yield f"stage {q.stage_index} loads {q.gguf_source}, not the model's {m.gguf_source}"


def valid_specs(s: Subject) -> Iterator[str]:
    m = s.plan.model
    if m.dtype_width_bytes not in VALID_WIDTHS[m.dtype_family]:
        yield f"the model's dtype {m.dtype_family.value}/{m.dtype_width_bytes} has no such width"
    if m.dtype_family is DTypeFamily.UINT:
        yield "the model's activations are integers; activations are float rows"
    if m.kv_dtype_width_bytes not in VALID_WIDTHS[DTypeFamily.FLOAT]:
        yield (
            f"the model's KV cache width {m.kv_dtype_width_bytes} is no cache's (float16: 2, "
            "float32: 4)"
        )
    elif s.inputs is not None:
        c = s.inputs.config
        counted = kv_width(c.worker, c.activation_dtype_width_bytes)
        if m.kv_dtype_width_bytes != counted:
            yield (
                f"the model's KV cache width is {m.kv_dtype_width_bytes}; the config's worker "
                f"and activations count {counted}"
            )
    for e in s.plan.edges:
        spec, ring = e.object_spec, e.ring_spec
        if not 1 <= spec.max_extent <= U64_MAX:
            yield f"edge {e.edge_id}'s max_extent {spec.max_extent} is not in 1..2**64-1"
        if not _power_of_two(ring.alignment):
            yield f"edge {e.edge_id}'s ring alignment {ring.alignment} is not a power of two"
        if spec.dtype_width_bytes not in VALID_WIDTHS[spec.dtype_family]:
            yield (
                f"edge {e.edge_id}'s dtype width {spec.dtype_width_bytes} does not match "
                f"{spec.dtype_family.value}"
            )
        kind, layouts = CARRIES[e.kind]
        if spec.kind is not kind or spec.layout not in layouts:
            yield (
                f"{e.kind.value} edge {e.edge_id} carries {spec.kind.value}/{spec.layout.value} "
                "objects, which this edge kind does not"
            )
