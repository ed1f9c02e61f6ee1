"""CUDA stage processes without a GPU: the CUDA worker on the SIMT emulator, for tests.

    python -m tests.support.simt_stage [--order ORDER] [--matvec q8|f32] -- STAGE ARGUMENTS

runs ``runtime_cupy.process.stage_process.main`` with the stage arguments (as
``python -m runtime_cupy.process.stage_process`` would); a stage asked for the ``cuda``
worker runs ``EmulatedCudaWorker`` (``cuda/backend.py`` and ``ops.py`` on the emulated CuPy, the
kernels' real source on the emulator, in thread order ORDER: ``forward``, ``reverse``
or ``random:SEED``); any other worker is the registry's. ``SimtHost`` is the
local-process host whose stages are such processes: the emulation enters through the
host port, and nothing of it is in the production stage. ``run_emulated`` plans and runs
one run of the CUDA worker through it (the planner sees the CUDA worker's capabilities
and f16 activations, as ``runtime_cupy.generate(worker="cuda")`` plans).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from runplan import NodeSpec, RuntimeConfig, SamplingConfig, Timeouts
from runplan.dtypes import DTypeFamily
from runtime_core.runs import facts_for_run, plan_even
from runtime_core.workers.interface import TraceEvent, Worker
from runtime_cupy.cuda.worker import CUDA_CAPABILITIES
from runtime_cupy.hosts.port import StageLaunch
from runtime_cupy.process import stage_process as stage
from runtime_cupy.process.launcher import ORCHESTRATOR, ProcessRun, ProcessRunResult
from runtime_cupy.workers import make_worker
from tests.support.simt.loader import FORWARD, ThreadOrder, random_order
from tests.support.tree_host import RepoTreeHost

#: A step's time per row on the emulator: each prompt row takes the one-row kernels, a
#: decode step's work (some 6 million emulated CUDA threads for a SmolLM2 row; 20 CPU
#: seconds for SmolLM2's 14 decode steps before prompts took them too), so a
#: real worker's 100 ms a row timed SmolLM2's 39-token prompt out (alone and in a suite).
#: Ten seconds a row leaves room for a loaded 2-core host.
EMULATED_ROW_MS = 10_000


def parse_order(text: str) -> ThreadOrder:
    kind, _, seed = text.partition(":")
    try:
        return random_order(int(seed)) if kind == "random" else ThreadOrder(kind)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad thread order {text!r}: {exc}") from exc


def order_text(order: ThreadOrder) -> str:
    return f"random:{order.seed}" if order.kind == "random" else order.kind


class SimtHost(RepoTreeHost):
    """The local-process host, its CUDA stages on the emulator (``matvec``, ``order``)."""

    def __init__(
        self, *, matvec: str = "q8", order: ThreadOrder = FORWARD, log_dir: Path | None = None
    ) -> None:
        super().__init__(log_dir=log_dir)
        self.matvec = matvec
        self.order = order

    def command(self, launch: StageLaunch, arguments: Sequence[str]) -> list[str]:
        return [
            sys.executable, "-m", "tests.support.simt_stage", "--order", order_text(self.order),
            "--matvec", self.matvec, "--", *arguments,
        ]  # fmt: skip


def run_emulated(
    model_path: str,
    prompt: Sequence[int],
    *,
    stages: int,
    max_tokens: int,
    host: SimtHost,
    return_logits: bool = True,
    activation_bytes: int = 2,
) -> ProcessRunResult:
    """One run of the CUDA worker in ``stages`` processes of ``host`` (greedy), its
    activations float16 between stages (as a CUDA run plans them) or float32 (4)."""
    facts = facts_for_run(model_path, prompt_len=len(prompt), max_tokens=max_tokens)
    config = RuntimeConfig(
        run_id=f"simt-{uuid.uuid4().hex[:12]}",
        max_tokens=max_tokens,
        activation_dtype_family=DTypeFamily.FLOAT,
        activation_dtype_width_bytes=activation_bytes,
        sampling=SamplingConfig(),
        return_logits=return_logits,
        worker=CUDA_CAPABILITIES,
        timeouts=Timeouts(step_row_ms=EMULATED_ROW_MS),
    )
    nodes = tuple(NodeSpec(f"stage-{i}", 2**40, device="emulated") for i in range(stages))
    plan = plan_even(facts, config, ORCHESTRATOR, nodes)
    return ProcessRun(plan, prompt, worker="cuda", host=host).run()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    split = args.index("--") if "--" in args else len(args)
    parser = argparse.ArgumentParser(prog="python -m tests.support.simt_stage")
    parser.add_argument("--order", type=parse_order, default=FORWARD)
    parser.add_argument("--matvec", choices=("q8", "f32"), default="q8")
    options = parser.parse_args(args[:split])
    from tests.support.emulated_cupy import EmulatedCudaWorker

    EmulatedCudaWorker.order = options.order

    def make(name: str, trace: TraceEvent | None) -> Worker:
        if name == "cuda":
            return EmulatedCudaWorker(matvec=options.matvec, trace=trace)
        return make_worker(name, trace)

    return stage.main(args[split + 1 :], make)


if __name__ == "__main__":
    stage.exit_now(main())
