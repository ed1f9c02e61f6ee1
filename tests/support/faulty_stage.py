"""A stage process that plays faults on purpose, for tests:

    python -m tests.support.faulty_stage [--fault FAULT]... -- STAGE ARGUMENTS

It runs ``runtime_cupy.process.stage_process.main`` with the stage arguments, its worker (from the
registry) wrapped in ``FaultyWorker``. Faults: ``setup-delay=SECONDS``,
``step-delay=SEQUENCE:SECONDS``, ``step-fail=SEQUENCE`` (that run's step fails alone),
``kv-full=N`` (the N-th run's KV cache finds no room), and ``attach-delay=SECONDS``
(each try to attach the outbound edge takes that long more: a producer on a busy host,
slow to answer its consumer's handshake). Started by ``FaultyHost``
(``tests/support/hosts.py``): the faults come in through the host port, and nothing of
them is in the production stage.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from attrs import frozen

from runplan import GgufSource, ProvisionStage, WorkerCapabilities
from runplan.plan import RingSpec
from runtime_core.workers.interface import (
    BatchStep,
    KvCacheUnavailable,
    Progress,
    StepFailure,
    StepResult,
    TokenOutput,
    Worker,
    WorkerError,
)
from runtime_cupy.edges.port import EdgeMedium, ProcessRing
from runtime_cupy.hosts.local import local_medium
from runtime_cupy.process import stage_process as stage
from runtime_cupy.workers import make_worker

log = logging.getLogger("runtime_cupy.process.stage_process")


@frozen
class Fault:
    """``setup-delay=SECONDS``, ``step-delay=SEQUENCE:SECONDS`` or ``step-fail=SEQUENCE``."""

    kind: str
    sequence: int | None = None
    seconds: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, _, value = text.partition("=")
        try:
            if kind in ("setup-delay", "attach-delay"):
                return cls(kind, None, float(value))
            if kind == "step-delay":
                seq, _, secs = value.partition(":")
                return cls(kind, int(seq), float(secs))
            if kind in ("step-fail", "kv-full"):
                return cls(kind, int(value))
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(
            f"bad fault {text!r}: setup-delay=S, step-delay=SEQ:S, step-fail=SEQ, kv-full=N "
            "or attach-delay=S"
        )


class FaultyWorker:
    """A worker that delays or fails where its faults say, else does what ``inner`` does."""

    capabilities: ClassVar[WorkerCapabilities] = WorkerCapabilities()

    def __init__(self, inner: Worker, faults: Sequence[Fault]) -> None:
        self.inner = inner
        self.faults = tuple(faults)
        self.opened = 0  # runs opened so far (kv-full=N refuses the N-th)

    def configure(self, provision: ProvisionStage) -> None:
        for f in self.faults:
            if f.kind == "setup-delay":
                log.warning("injected fault: setup delayed %.3f s", f.seconds)
                time.sleep(f.seconds)
        self.inner.configure(provision)

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None:
        self.inner.bind(gguf_source, progress)

    @property
    def kv_reserved_bytes(self) -> int:
        return self.inner.kv_reserved_bytes

    def _failed(self, sequence: int) -> str | None:
        """Play the faults of a step at ``sequence``: a delay, or a failure (its text)."""
        failure = None
        for f in self.faults:
            if f.sequence == sequence and f.kind == "step-delay":
                log.warning("injected fault: step %d delayed %.3f s", sequence, f.seconds)
                time.sleep(f.seconds)
            if f.sequence == sequence and f.kind == "step-fail":
                log.warning("injected fault: step %d fails", sequence)
                failure = f"injected failure at sequence {sequence}"
        return failure

    def execute_step(self, sequence: int, data: Any) -> Any | TokenOutput:
        failure = self._failed(sequence)
        if failure is not None:
            raise WorkerError(failure)
        return self.inner.execute_step(sequence, data)

    def open_run(self, provision: ProvisionStage) -> None:
        self.opened += 1
        for f in self.faults:
            if f.kind == "kv-full" and f.sequence == self.opened:
                log.warning("injected fault: no room for run %d's cache", self.opened)
                budget = provision.kv_budget_bytes
                raise KvCacheUnavailable(provision.run_id, provision.kv_bytes, 0, budget)
        self.inner.open_run(provision)

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]:
        """The batch's steps; a step whose sequence a ``step-fail`` names is that run's
        ``StepFailure`` (the others' results stand)."""
        failures = [self._failed(step.sequence) for step in steps]
        kept = [step for step, failure in zip(steps, failures, strict=True) if failure is None]
        results = iter(self.inner.execute_batch(kept) if kept else ())
        return tuple(
            next(results) if failure is None else StepFailure(failure) for failure in failures
        )

    def close_run(self, run_id: str) -> None:
        self.inner.close_run(run_id)

    def release(self) -> None:
        self.inner.release()


class SlowAttach:
    """A medium whose ``attach`` takes ``seconds`` longer each time (else ``inner``)."""

    def __init__(self, inner: EdgeMedium, seconds: float) -> None:
        self.inner, self.seconds, self.name = inner, seconds, inner.name

    def create(self, run_id: str, edge_id: int, spec: RingSpec, key: bytes) -> ProcessRing:
        return self.inner.create(run_id, edge_id, spec, key)

    def attach(self, run_id: str, edge_id: int, spec: RingSpec, key: bytes) -> ProcessRing | None:
        time.sleep(self.seconds)
        return self.inner.attach(run_id, edge_id, spec, key)

    def remove(self, run_id: str, edge_id: int) -> None:
        self.inner.remove(run_id, edge_id)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    split = args.index("--") if "--" in args else len(args)
    parser = argparse.ArgumentParser(prog="python -m tests.support.faulty_stage")
    parser.add_argument("--fault", type=Fault.parse, action="append", default=[])
    faults = parser.parse_args(args[:split]).fault
    slow = sum(f.seconds for f in faults if f.kind == "attach-delay")

    def media(name: str, encrypt: bool) -> EdgeMedium:
        medium = local_medium(name, encrypt)
        return SlowAttach(medium, slow) if slow else medium

    return stage.main(
        args[split + 1 :],
        lambda name, trace: FaultyWorker(make_worker(name, trace), faults),
        media=media,
    )


if __name__ == "__main__":
    stage.exit_now(main())
