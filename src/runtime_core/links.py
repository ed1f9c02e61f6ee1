"""A chain's links (CONCURRENT_RUNS.md §1-§2): one ring per hop, in pipeline order
(token-in, the activations between stages, token-out), made once for the chain and
carrying the records of every run on it.

``LinkSender`` writes records of any run (each names its run and edge in its header).
``LinkReceiver`` takes the next record: it parses the header, copies the payload out
and releases the slot at once, so a link never waits on a run that is not executing.
This keeps EDGES_AND_WORKERS.md §2's rule that a slot is not reused while its payload
may be read: once copied, nothing reads the slot again (the step reads the copy). The
checks that depend on the run (its run id, edge, sequence, chunk, object spec) are the
receiver's caller's, after it has routed the record to its run; a header that does not
parse is the link's fault (``LinkFault``): the link is corrupt, whatever run it carried
(its reader's ``PROTOCOL_VIOLATION``: another version or a garbled header, which no
re-placed chain would read better).

``LocalLinks`` is the in-process transport of a chain's links (tests; the simulator
later): a ring per hop, made by its consumer, found by its producer.
"""

from __future__ import annotations

from attrs import frozen

from runplan import ProvisionStage, RunPlan
from runplan.plan import OBJECT_HEADER_BYTES, ObjectKind, RingSpec
from runplan.record_header import HeaderDType, HeaderError, ObjectHeader
from runplan.specs import ring_spec
from runtime_core.ring import LocalRing, Ring, RingError


class LinkFault(RuntimeError):
    """A link that cannot be read: a record whose header does not parse or whose payload
    overruns its slot, or a ring whose counters another hand changed. A fault of the
    chain, not of one run."""


@frozen
class Taken:
    """A record taken off a link: its header and a copy of its payload."""

    header: ObjectHeader
    payload: bytes


class LinkSender:
    """The producer end of one hop of a chain."""

    def __init__(self, ring: Ring, kind: ObjectKind) -> None:
        self.ring = ring
        self.kind = kind

    def try_send(
        self,
        run_id: str,
        edge_id: int,
        sequence: int,
        rows: int,
        dtype: HeaderDType,
        payload: bytes,
        chunk_index: int = 0,
        chunk_count: int = 1,
    ) -> bool:
        """Write and publish one record; ``False`` (nothing written) while the ring is
        full: the backpressure. ``EdgeClosed`` once the link is closed; ``RingError`` or
        ``HeaderError`` (nothing written) for a record no slot or header can hold."""
        room = self.ring.spec.slot_bytes - OBJECT_HEADER_BYTES
        if not 0 < len(payload) <= room:
            raise RingError(f"payload of {len(payload)} bytes; a slot of this link holds {room}")
        header = ObjectHeader(
            run_id,
            edge_id,
            sequence,
            self.kind,
            dtype,
            rows,
            len(payload),
            chunk_index,
            chunk_count,
        ).pack()
        slot = self.ring.try_reserve()
        if slot is None:
            return False
        view = self.ring.slot(slot)
        view[:OBJECT_HEADER_BYTES] = header
        view[OBJECT_HEADER_BYTES : OBJECT_HEADER_BYTES + len(payload)] = payload
        self.ring.publish(slot)
        return True

    def close(self) -> None:
        self.ring.close()


class LinkReceiver:
    """The consumer end of one hop of a chain."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring

    def try_take(self) -> Taken | None:
        """The next record, its payload copied and its slot released; ``None`` if none
        is published. ``LinkFault`` (the slot kept) for a record that cannot be read, or
        whose slot cannot be released (the shared ``released`` counter changed by
        another process of this user's); ``EdgeClosed`` once the link is closed."""
        slot = self.ring.try_acquire()
        if slot is None:
            return None
        view = self.ring.slot(slot)
        try:
            header = ObjectHeader.unpack(view)
        except HeaderError as exc:
            raise LinkFault(f"bad header: {exc}") from None
        end = OBJECT_HEADER_BYTES + header.extent_bytes
        if end > len(view):
            raise LinkFault(
                f"a record of {header.extent_bytes} bytes overruns its slot of {len(view)}"
            )
        payload = bytes(view[OBJECT_HEADER_BYTES:end])
        try:
            self.ring.release(slot)
        except RingError as exc:  # only this end writes the counter: another hand did
            raise LinkFault(f"its released counter was changed: {exc}") from None
        return Taken(header, payload)

    def close(self) -> None:
        self.ring.close()


def link_ring_spec(slot_count: int, alignment: int, max_extent: int) -> RingSpec:
    """The ring of a link whose largest record is ``max_extent`` bytes."""
    return ring_spec(max_extent, slot_count, alignment)


class LocalLinks:
    """A chain's links inside one process: a ring per hop (hop ``i`` feeds stage ``i``;
    hop ``stage_count`` is token-out), made by the consumer end, found by the producer.
    Serves both the stages (``open_inbound`` / ``open_outbound``) and the orchestrator
    (``open_token_out`` / ``open_token_in``) of one chain."""

    def __init__(self) -> None:
        self.rings: dict[int, Ring] = {}

    def _make(self, hop: int, spec: RingSpec) -> Ring:
        if hop in self.rings:
            raise RuntimeError(f"hop {hop} of the chain already has its consumer")
        ring = self.rings[hop] = self.new_ring(hop, spec)
        return ring

    def new_ring(self, hop: int, spec: RingSpec) -> Ring:
        """The ring of hop ``hop`` (a subclass may make its own kind)."""
        return LocalRing(spec)

    # -- stages ---------------------------------------------------------------------------
    def open_inbound(self, provision: ProvisionStage) -> LinkReceiver:
        return LinkReceiver(self._make(provision.stage_index, provision.inbound.ring_spec))

    def open_outbound(self, provision: ProvisionStage) -> LinkSender | None:
        ring = self.rings.get(provision.stage_index + 1)
        if ring is None:
            return None
        return LinkSender(ring, provision.outbound.object_spec.kind)

    # -- the orchestrator -------------------------------------------------------------------
    def open_token_out(self, plan: RunPlan) -> LinkReceiver:
        """Token-out, sized for a token id and the raw logits whatever the run that
        opens it asks: every run of the chain shares it."""
        edge = plan.token_out
        spec = link_ring_spec(
            edge.ring_spec.slot_count, edge.ring_spec.alignment, 4 + 4 * plan.model.vocab_size
        )
        return LinkReceiver(self._make(plan.stage_count, spec))

    def open_token_in(self, plan: RunPlan) -> LinkSender | None:
        ring = self.rings.get(0)
        return None if ring is None else LinkSender(ring, ObjectKind.TOKEN)
