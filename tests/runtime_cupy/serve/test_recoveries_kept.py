"""``serve.recovery.Recoveries``: what a chain keeps of its recoveries is bounded. A
server whose stages kept dying kept every replacement (a run plan each) and every
stream's times for as long as it ran (found by a soak of the server); it keeps the
newest ``KEPT`` now, and still counts them all."""

from __future__ import annotations

from typing import Any

from runtime_cupy.serve import recovery
from runtime_cupy.serve.recovery import Recoveries, RecoveryTimes


def test_a_chain_keeps_the_newest_recoveries_and_counts_them_all() -> None:
    kept = recovery.KEPT
    recoveries = Recoveries()
    losses = kept * 3 + 5
    for i in range(losses):
        replacement: Any = ("replacement", i)  # (kept as it is given)
        recoveries.placed(replacement)
        recoveries.recovered(RecoveryTimes(float(i), i + 0.1, i + 0.2, i + 0.3, i + 0.4, i + 2.0))
    assert recoveries.placements == losses and recoveries.count == losses
    assert recoveries.seconds == 2.0 * losses
    assert len(recoveries.replacements) == kept and len(recoveries.times) == kept
    held: list[Any] = list(recoveries.replacements)
    assert held[-1] == ("replacement", losses - 1) and held[0] == ("replacement", losses - kept)
    assert recoveries.times[-1].ended_s == float(losses - 1)
