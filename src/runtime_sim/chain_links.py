"""A chain's links in the simulation (CONCURRENT_RUNS.md §1-§2): one ring per hop
(token-in, the activations between stages, token-out), each carrying every run's
records. A record reaches its consumer a hop after it is published (latency plus bytes
over bandwidth, from the timing model); a full ring blocks its producer in virtual
time; every operation is traced with the record's run, sequence and chunk, so the
checker can follow each run's records through the shared rings."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from runplan.plan import OBJECT_HEADER_BYTES, RingSpec
from runplan.record_header import ObjectHeader
from runtime_core.links import LocalLinks
from runtime_core.ring import LocalRing, Ring
from runtime_sim.links import ORCHESTRATOR

if TYPE_CHECKING:
    from runtime_sim.chain_driver import ChainSimulation

_U32 = struct.Struct("<I")


class _Quiet:
    """Rings signal through the scheduler here, not through this."""

    def notify(self) -> None:
        pass

    def wait(self, timeout_s: float) -> None:
        pass


class ChainRing(LocalRing):
    """Hop ``hop`` of the chain: records take a hop's time to arrive; publish, acquire
    and release are traced as ``("ring", op, (hop, n, slot, run_id, sequence, chunk,
    token))`` (``token``: the id a token record carries, else ``None``)."""

    def __init__(self, sim: ChainSimulation, hop: int, spec: RingSpec) -> None:
        super().__init__(spec, data=_Quiet(), space=_Quiet())
        self.sim = sim
        self.hop = hop
        stages = len(sim.stages)
        self.producer_id = ORCHESTRATOR if hop == 0 else sim.stages[hop - 1].node_id
        self.consumer_id = ORCHESTRATOR if hop == stages else sim.stages[hop].node_id
        self.visible_at: dict[int, int] = {}
        self.hop_us: dict[int, int] = {}

    def _header(self, index: int) -> tuple[str, int, int, int | None, int]:
        """The record's run, sequence, chunk, token id (a token record's, else None) and
        payload bytes."""
        view = self.slot(index)
        h = ObjectHeader.unpack(view)
        token = None
        if h.dtype.name == "U32" and h.extent_bytes >= 4:
            (token,) = _U32.unpack_from(view, OBJECT_HEADER_BYTES)
        return h.run_id, h.sequence, h.chunk_index, token, h.extent_bytes

    def publish(self, index: int) -> None:
        n = self._reserved
        super().publish(index)
        assert n is not None
        sim = self.sim
        run_id, sequence, chunk, token, extent = self._header(index)
        delay = self.hop_us.get(extent)
        if delay is None:
            delay = self.hop_us[extent] = int(
                sim.settings.timing.hop_us(OBJECT_HEADER_BYTES + extent)
            )
        delay += sim.link_delay_us(self.hop, run_id, sequence)
        now = sim.clock.now_us
        self.visible_at[n] = now + delay
        detail = (self.hop, n, index, run_id, sequence, chunk, token)
        sim.trace.add(now, self.producer_id, "ring", "publish", *detail)
        sim.clock.after(delay, sim.node(self.consumer_id).wake)

    def try_acquire(self) -> int | None:
        n = self._acquired
        now = self.sim.clock.now_us
        if n < self.published and self.visible_at.get(n, 0) > now:
            return None  # still in flight
        index = super().try_acquire()
        if index is not None:
            run_id, sequence, chunk, token, _ = self._header(index)
            detail = (self.hop, n, index, run_id, sequence, chunk, token)
            self.sim.trace.add(now, self.consumer_id, "ring", "acquire", *detail)
        return index

    def release(self, index: int) -> None:
        n = self.released
        super().release(index)
        sim = self.sim
        sim.trace.add(sim.clock.now_us, self.consumer_id, "ring", "release", self.hop, n, index)
        producer = sim.node(self.producer_id)
        if producer.waiting_for_space:
            sim.clock.after(int(sim.settings.timing.link.latency_us), producer.wake)

    def close(self) -> None:
        sim = self.sim
        if not self.closed:
            sim.trace.add(sim.clock.now_us, "sim", "ring", "close", self.hop)
        super().close()
        for node_id in (self.producer_id, self.consumer_id):
            sim.clock.after(0, sim.node(node_id).wake)

    def forge(self, header: ObjectHeader, payload: bytes, actor: str) -> bool:
        """Write a record no stage produced (a forgery of the fault plan), visible at
        once; ``False`` when the ring has no free slot."""
        index = self.try_reserve()
        if index is None:
            return False
        n = self.published
        view = self.slot(index)
        view[:OBJECT_HEADER_BYTES] = header.pack()
        view[OBJECT_HEADER_BYTES : OBJECT_HEADER_BYTES + len(payload)] = payload
        now = self.sim.clock.now_us
        self.visible_at[n] = now
        Ring.publish(self, index)
        detail = (self.hop, n, index, header.run_id, header.sequence, header.chunk_index, None)
        self.sim.trace.add(now, actor, "ring", "publish", *detail)
        self.sim.clock.after(0, self.sim.node(self.consumer_id).wake)
        return True


class SimChainLinks(LocalLinks):
    """The chain's rings, made through the simulation's ``Parts`` (a mutant ring may
    take the place of the production one)."""

    def __init__(self, sim: ChainSimulation) -> None:
        super().__init__()
        self.sim = sim

    def new_ring(self, hop: int, spec: RingSpec) -> Ring:
        return self.sim.parts.ring(self.sim, hop, spec)

    def ring(self, hop: int) -> ChainRing | None:
        ring = self.rings.get(hop)
        return ring if isinstance(ring, ChainRing) else None
