"""What a chain's runner does with the runs a fault ended: re-place and replay them, or
end them as before (issue 25). Pure: the runner carries the decisions out
(``runplan.replacement.replace_lost`` for the chain, ``runtime_core.replay`` for each
run).

A run is recovered when it ended ``FAULTED`` by the loss of a stage process, a host or
a link:

- ``PROCESS_DIED`` (the runtime's notice that a stage process or its host is gone) and
  ``STAGE_SILENT`` (no heartbeat within the bound: a host lost or cut off) are always
  the chain's: the stage they name is lost;
- ``EDGE_FAULT`` is a lost link when a stage's link broke (a ``ChainStageController``
  chain fault: its detail begins ``inbound link`` or ``outbound link``; both ends of
  that link are lost, the stage that saw it and its neighbour) or when the runtime says
  the chain's token links broke (``chain_fault``: ``ChainOrchestrator.broken``, an
  ``EDGE_FAULT``); otherwise it is the run's own bad record, which ends that run as
  today;
- every other fault (a step failure, a timeout, a refused cache, a rejected message, a
  record a stage or the orchestrator cannot read: ``PROTOCOL_VIOLATION``, another
  version or a garbled header, which a re-placed chain would read no better) ends the
  run as today.

And only while the stream has recoveries left (``max_recoveries`` per stream, default 2,
counted in ``Interrupted.recoveries``) and has not ended already (its last token
delivered: the runner completes it as it stands).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from attrs import frozen

from runplan._fields import int_field, int_tuple_field, str_field, tuple_field, typed_field
from runplan.fsm.orchestrator_actions import RunFinished
from runplan.messages import FaultKind, FaultReason, StopReason
from runtime_core.replay import Interrupted
from runtime_core.stage_data_path import INBOUND_LINK, OUTBOUND_LINK

#: Faults that are always a lost stage process or host.
LOSSES = frozenset({FaultKind.PROCESS_DIED, FaultKind.STAGE_SILENT})
#: Faults that are a lost link when they are the chain's.
LINK_LOSSES = frozenset({FaultKind.EDGE_FAULT})


class LostLink(enum.Enum):
    """Which link of the stage a fault names."""

    INBOUND = "INBOUND"  # from the stage before (stage 0: token-in)
    OUTBOUND = "OUTBOUND"  # to the stage after (the last stage: token-out)
    TOKEN_LINKS = "TOKEN_LINKS"  # the orchestrator's token links


DEFAULT_MAX_RECOVERIES = 2


class EndReason(enum.Enum):
    NOT_FAULTED = "NOT_FAULTED"  # completed or cancelled: nothing to recover
    NOT_A_LOSS = "NOT_A_LOSS"  # a fault other than a lost process, host or link
    RUN_FAULT = "RUN_FAULT"  # an edge fault of this run alone (its own bad record)
    ALREADY_ENDED = "ALREADY_ENDED"  # the stream had ended: complete it as it stands
    RECOVERIES_SPENT = "RECOVERIES_SPENT"  # max_recoveries reached


@frozen
class Recover:
    """Re-place the chain and replay this run: the stream's recovery number
    ``recovery`` (1 for the first), because of ``cause`` at ``stage`` (the stage the
    fault names, if any), on ``link`` when a link was lost."""

    run_id: str = str_field()
    recovery: int = int_field()
    cause: FaultReason = typed_field(FaultReason)
    stage: int | None = typed_field((int, type(None)))
    link: LostLink | None = typed_field((LostLink, type(None)), default=None)

    def lost_stages(self, stage_count: int) -> tuple[int, ...]:
        """The stages of a chain of ``stage_count`` this loss takes: the stage named;
        for a link, both its ends (the one before an inbound link, the one after an
        outbound link), as which end failed is not known."""
        if self.stage is None:
            return ()
        lost = {self.stage}
        if self.link is LostLink.INBOUND and self.stage > 0:
            lost.add(self.stage - 1)
        if self.link is LostLink.OUTBOUND and self.stage + 1 < stage_count:
            lost.add(self.stage + 1)
        return tuple(sorted(s for s in lost if 0 <= s < stage_count))


@frozen
class End:
    """End this run as today (its outcome stands), because of ``reason``."""

    run_id: str = str_field()
    reason: EndReason = typed_field(EndReason)
    detail: str = str_field()


@frozen
class ChainRecovery:
    """The decisions for the runs one fault ended: which stages the chain lost (for
    ``replace_lost``; empty when no run is recovered), and each run's decision."""

    lost_stages: tuple[int, ...] = int_tuple_field()
    recover: tuple[Recover, ...] = tuple_field(Recover)
    end: tuple[End, ...] = tuple_field(End)


@frozen
class RecoveryPolicy:
    """When a run a fault ended is re-placed and replayed; ``max_recoveries`` per
    stream (0: never)."""

    max_recoveries: int = int_field(default=DEFAULT_MAX_RECOVERIES)

    @max_recoveries.validator
    def _count(self, _: object, value: int) -> None:
        if not 0 <= value <= 2**32 - 1:
            raise ValueError(f"max_recoveries {value} is not in 0..2**32-1")

    def decide(
        self,
        interrupted: Interrupted,
        finished: RunFinished,
        *,
        chain_fault: FaultReason | None = None,
    ) -> Recover | End:
        """The decision for one run that ended with ``finished``, having delivered
        ``interrupted.delivered``; ``chain_fault``: the chain's fault as the runtime
        knows it (``ChainOrchestrator.broken``), if any."""
        run_id = interrupted.run_id
        fault = finished.fault
        if finished.outcome is not StopReason.FAULTED or fault is None:
            return End(run_id, EndReason.NOT_FAULTED, f"the run ended {finished.outcome.value}")
        if chain_fault is not None and chain_fault.kind is FaultKind.PROTOCOL_VIOLATION:
            return End(run_id, EndReason.NOT_A_LOSS, f"{chain_fault} is not a lost link")
        if fault.kind not in LOSSES | LINK_LOSSES:
            return End(run_id, EndReason.NOT_A_LOSS, f"{fault} is not a lost process, host or link")
        link = _lost_link(fault, chain_fault)
        if fault.kind in LINK_LOSSES and link is None:
            return End(run_id, EndReason.RUN_FAULT, f"{fault} is this run's, not the chain's")
        if interrupted.ended:
            return End(
                run_id,
                EndReason.ALREADY_ENDED,
                f"its {len(interrupted.delivered)} tokens were all delivered before {fault}",
            )
        if interrupted.recoveries >= self.max_recoveries:
            return End(
                run_id,
                EndReason.RECOVERIES_SPENT,
                f"recovered {interrupted.recoveries} times (max_recoveries "
                f"{self.max_recoveries}); then {fault}",
            )
        return Recover(run_id, interrupted.recoveries + 1, fault, finished.fault_stage, link)

    def decide_chain(
        self,
        ended: Sequence[tuple[Interrupted, RunFinished]],
        stage_count: int,
        *,
        chain_fault: FaultReason | None = None,
    ) -> ChainRecovery:
        """The decisions for every run one fault ended on a chain of ``stage_count``
        stages, and the stages the chain lost (those the recovered runs' faults
        take)."""
        recover: list[Recover] = []
        end: list[End] = []
        for interrupted, finished in ended:
            decision = self.decide(interrupted, finished, chain_fault=chain_fault)
            if isinstance(decision, Recover):
                recover.append(decision)
            else:
                end.append(decision)
        lost = sorted({s for r in recover for s in r.lost_stages(stage_count)})
        return ChainRecovery(tuple(lost), tuple(recover), tuple(end))


def _lost_link(fault: FaultReason, chain_fault: FaultReason | None) -> LostLink | None:
    """The link an ``EDGE_FAULT`` says was lost, if it is a chain's."""
    if fault.kind is not FaultKind.EDGE_FAULT:
        return None
    if fault.detail.startswith(INBOUND_LINK):
        return LostLink.INBOUND
    if fault.detail.startswith(OUTBOUND_LINK):
        return LostLink.OUTBOUND
    if chain_fault is not None and chain_fault.kind is FaultKind.EDGE_FAULT:
        return LostLink.TOKEN_LINKS
    return None
