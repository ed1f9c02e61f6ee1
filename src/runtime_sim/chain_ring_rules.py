"""The ring rules of a chain's links (EDGES_AND_WORKERS.md §2, CONCURRENT_RUNS.md §2),
read off the trace's ring entries: no slot overwritten before its release, records read
in publish order from the slot they were published into, and each record's slot
released at load (after its payload is copied), before the next record is read."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

NO_OVERWRITE = "ring: no slot overwritten before release"
PUBLISH_ORDER = "ring: records leave in publish order"
RELEASE_AT_LOAD = "ring: a receiving end releases a record's slot at load, after copying it"

#: ``fail(rule, time_us, detail)``.
Fail = Callable[[str, int, str], None]


class RingRules:
    """Follows every hop's ring operations, in trace order."""

    def __init__(self, slots: dict[int, int], fail: Fail) -> None:
        self.slots = slots  # hop -> slot count
        self.fail = fail
        self.published_as: dict[tuple[int, int], tuple[int, str, int, int]] = {}
        self.released: dict[int, set[int]] = defaultdict(set)
        self.acquired: dict[int, int] = defaultdict(int)
        self.holding: dict[int, tuple[int, int] | None] = {}  # hop -> (record, load time)

    def publish(
        self, time_us: int, hop: int, n: int, slot: int, run_id: str, sequence: int, chunk: int
    ) -> None:
        slots = self.slots[hop]
        if n >= slots and (n - slots) not in self.released[hop]:
            self.fail(
                NO_OVERWRITE,
                time_us,
                f"hop {hop} record {n} into slot {slot} while record {n - slots} is unreleased",
            )
        self.published_as[(hop, n)] = (slot, run_id, sequence, chunk)

    def acquire(
        self, time_us: int, hop: int, n: int, slot: int, run_id: str, sequence: int, chunk: int
    ) -> None:
        expected = self.acquired[hop]
        if n != expected or self.published_as.get((hop, n)) != (slot, run_id, sequence, chunk):
            self.fail(
                PUBLISH_ORDER,
                time_us,
                f"hop {hop}: read record {n} ({run_id!r} sequence {sequence}) from slot "
                f"{slot}; the oldest unread was record {expected}, published as "
                f"{self.published_as.get((hop, expected))}",
            )
        self.acquired[hop] = expected + 1
        held = self.holding.get(hop)
        if held is not None:
            self.fail(
                RELEASE_AT_LOAD,
                time_us,
                f"hop {hop}: record {n} read while record {held[0]} is held",
            )
        self.holding[hop] = (n, time_us)

    def release(self, time_us: int, hop: int, n: int) -> None:
        self.released[hop].add(n)
        held = self.holding.get(hop)
        if held is not None and held[0] == n:
            if held[1] != time_us:
                self.fail(
                    RELEASE_AT_LOAD,
                    time_us,
                    f"hop {hop}: record {n} released {time_us - held[1]} us after its load",
                )
            self.holding[hop] = None

    def finish(self) -> None:
        """A record read and never released breaks the rule too."""
        for hop, held in self.holding.items():
            if held is not None:
                self.fail(RELEASE_AT_LOAD, held[1], f"hop {hop}: record {held[0]} never released")
