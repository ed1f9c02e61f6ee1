"""Damaged GGUF files through every entry point that reads them, in the order a run
meets them: facts (``model_facts_from_gguf``), the tokenizer (``Tokenizer.from_gguf``,
an encode and a decode), the plan (``plan_run``: a rejection is a value), the slice
loader (``open_provisioned_slice`` for every stage of the plan) and one step (every
stage's ``ReferenceWorker`` bound and a prefill run through them).

A mutant ends at the first stage that refuses it. A refusal must be one of the
project's typed errors (``TYPED``), naming the file; anything else (a
``UnicodeDecodeError``, an ``IndexError``, a ``TypeError`` of our own) propagates and
fails the test, and Hypothesis shrinks the mutant that raised it. A ``WorkerError``
counts as typed only when what caused it is. There is no catch-all here: an exception
this module does not name is a failure. Each mutant runs under a time limit
(``MutantTimeout``, raised by a timer signal, so that a hang is caught while it hangs).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

import attrs
import hypothesis
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings

from runplan import (
    NodePool,
    NodeSpec,
    Placement,
    PlanRejection,
    RuntimeConfig,
    model_facts_from_gguf,
    plan_run,
    provision_all,
)
from runplan.gguf_error import GgufError
from runplan.models import resolve_model
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import open_provisioned_slice
from runtime_core.tokenizer import Tokenizer, TokenizerError
from runtime_core.workers.interface import TokenOutput, WorkerError
from runtime_core.workers.reference.worker import ReferenceWorker
from runtime_core.workers.sampling import NonFiniteLogits
from tests.fuzz.mutants import DEEP_KINDS, KINDS, Base, Mutant, mutants

TYPED: tuple[type[Exception], ...] = (GgufError, UnsupportedModel, TokenizerError, WorkerError)
#: What a typed ``WorkerError`` of a step may be caused by: logits no token can be
#: drawn from (damaged weights make NaN), besides the typed errors themselves.
STEP_CAUSES: tuple[type[Exception], ...] = (*TYPED, NonFiniteLogits)
STAGES = ("facts", "tokenizer", "plan", "slice", "step")
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"
#: Per mutant: facts alone (about 3 ms, 25 ms for SmolLM2; the slowest of 100,000 on a
#: loaded 2-core host took 3.8 s), and the whole pipeline (about 15 ms, 0.5 s for
#: SmolLM2's tokenizer). Far above what they take, so that a loaded machine does not
#: trip them, and far below a hang (a forged block count of billions took minutes).
FACTS_LIMIT_S = 20.0
DEEP_LIMIT_S = 120.0
#: The tallies of this process's fuzz runs, printed at the end of a pytest session.
REPORTS: list[Tally] = []
TEXT = "Hello, world! <|im_start|>user\nWhy is the sky blue?<|im_end|>"


class MutantTimeout(Exception):
    """A mutant ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    def expired(_signum: int, _frame: FrameType | None) -> None:
        raise MutantTimeout(f"{what} ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@attrs.define
class Tally:
    """What the mutants did: how many reached each stage, and each refusal by stage and
    kind (the error's type, ``WorkerError(<cause>)``, or ``rejected:<code>``)."""

    name: str
    mutants: int = 0
    reached: Counter[str] = attrs.field(factory=Counter)
    refused: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    passed: int = 0  # through every stage that was run
    seconds: float = 0.0  # running the mutants
    wall: float = 0.0  # all of it, Hypothesis drawing the mutants too
    slowest: tuple[float, str] = (0.0, "")

    def lines(self) -> list[str]:
        per = self.seconds / self.mutants * 1000 if self.mutants else 0.0
        out = [
            f"{self.name}: {self.mutants} mutants in {self.wall:.1f} s, {self.seconds:.1f} s "
            f"of it running them ({per:.1f} ms each; slowest {self.slowest[0] * 1000:.0f} "
            f"ms: {self.slowest[1]})"
        ]
        for stage in STAGES:
            if not self.reached[stage]:
                continue
            kinds = {k: n for (s, k), n in self.refused.items() if s == stage}
            shown = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
            out.append(
                f"  reached {stage:<9} {self.reached[stage]:>7}  refused {sum(kinds.values()):>7}"
                + (f"  ({shown})" if shown else "")
            )
        out.append(f"  passed every stage run: {self.passed}")
        return out


def load_bases(work_dir: Path) -> list[Base]:
    """SmolLM2 (llama.cpp's converter and quantizer), three tiny models quantized by
    llama.cpp (Q4_K llama with an untied head, Q5_0 qwen2 with biases, Q8_0 gemma3 with
    sliding-window blocks) and a generated F32 llama with llama3's ``rope_freqs`` and
    linear rope scaling."""
    from tests.fixtures.gguf_models import ModelShape, write_model

    generated = write_model(
        work_dir / "source-rope.gguf",
        ModelShape(n_layers=2, rope_freqs=True, rope_scaling_factor=4.0, seed=3),
    )
    return [
        Base.load("smollm2", Path(resolve_model("smollm2-135m")), work_dir, deep=False, large=True),
        Base.load("llama-q4k", FIXTURES / "tiny-llama-Q4_K.gguf", work_dir, deep=True),
        Base.load("qwen2-q5_0", FIXTURES / "tiny-qwen2-Q5_0.gguf", work_dir, deep=True),
        Base.load("gemma3-q8_0", FIXTURES / "tiny-gemma3-Q8_0.gguf", work_dir, deep=True),
        Base.load("llama-rope", generated, work_dir, deep=True),
    ]


def _names_file(exc: Exception, path: Path) -> bool:
    return path.name in str(exc)


def _kind(exc: Exception) -> str:
    if isinstance(exc, WorkerError) and exc.__cause__ is not None:
        return f"WorkerError({type(exc.__cause__).__name__})"
    return type(exc).__name__


def _check_typed(exc: Exception, path: Path, stage: str) -> str:
    """The kind of a refusal; raises what is not a typed error naming the file."""
    cause = exc.__cause__ if isinstance(exc, WorkerError) else None
    if cause is not None and not isinstance(cause, STEP_CAUSES if stage == "step" else TYPED):
        raise cause
    if stage != "step" and not _names_file(exc, path):
        raise AssertionError(f"{stage}: {type(exc).__name__} does not name {path}: {exc}")
    return _kind(exc)


def run_mutant(path: Path, tally: Tally, *, deep: bool, step: bool) -> None:
    """Run one mutant file through the stages (facts only unless ``deep``)."""
    stage = "facts"
    try:
        tally.reached[stage] += 1
        facts = model_facts_from_gguf(path, max_seq_len=8)
        if not deep:
            tally.passed += 1
            return
        stage = "tokenizer"
        tally.reached[stage] += 1
        tokenizer = Tokenizer.from_gguf(path)
        tokenizer.decode(tokenizer.encode(TEXT), special=True)
        stage = "plan"
        tally.reached[stage] += 1
        n = min(2, facts.num_layers)
        nodes = tuple(NodeSpec(f"n{i}", 2**40) for i in range(n))
        plan = plan_run(
            facts,
            RuntimeConfig(run_id="fuzz", max_tokens=1),
            NodePool("orch", nodes),
            stage_count=n,
            placement=Placement.even([node.node_id for node in nodes]),
        )
        if isinstance(plan, PlanRejection):
            tally.refused[(stage, f"rejected:{plan.code}")] += 1
            return
        provisions = provision_all(plan)
        stage = "slice"
        tally.reached[stage] += 1
        for p in provisions:
            open_provisioned_slice(facts.gguf_source, p, ReferenceWorker.capabilities).close()
        if not step:
            tally.passed += 1
            return
        stage = "step"
        tally.reached[stage] += 1
        workers = []
        try:
            for p in provisions:
                worker = ReferenceWorker()
                worker.configure(p)
                worker.bind(facts.gguf_source)
                workers.append(worker)
            out: np.ndarray | TokenOutput = np.array(
                [i % facts.vocab_size for i in (1, 2, 3)], dtype=np.uint32
            )
            for worker in workers:
                assert not isinstance(out, TokenOutput)
                out = worker.execute_step(0, out)
            assert isinstance(out, TokenOutput) and 0 <= out.token_id < facts.vocab_size, out
        finally:
            for worker in workers:
                worker.release()
        tally.passed += 1
    except TYPED as exc:
        tally.refused[(stage, _check_typed(exc, path, stage))] += 1


def run_one(base: Base, mutant: Mutant, tally: Tally, *, deep: bool) -> None:
    path = base.write(mutant)
    began = time.perf_counter()
    limit = DEEP_LIMIT_S if deep else FACTS_LIMIT_S
    try:
        with time_limit(limit, f"mutant of {base.name} ({_describe(base, mutant)})"):
            run_mutant(path, tally, deep=deep, step=deep and base.deep)
    finally:
        base.restore()
        spent = time.perf_counter() - began
        tally.mutants += 1
        tally.seconds += spent
        if spent > tally.slowest[0]:
            tally.slowest = (spent, f"{base.name}: {_describe(base, mutant)}")


def _describe(base: Base, mutant: Mutant) -> str:
    return "; ".join(op.describe(base) for op in mutant.ops)


def fuzz(
    bases: Sequence[Base],
    weights: Sequence[int],
    n: int,
    tally: Tally,
    *,
    deep: bool,
    derandomize: bool = False,
    seed: int | None = None,
    progress_every: int = 0,
) -> None:
    """Run ``n`` Hypothesis-drawn mutants (``weights``: how often each base is drawn):
    the same ones every time with ``derandomize``, those of ``seed`` with a seed; a
    line on standard error every ``progress_every`` mutants."""
    by_name = {b.name: b for b in bases}

    @settings(
        max_examples=n,
        deadline=None,
        derandomize=derandomize,
        database=None,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
    )
    @given(mutant=mutants(bases, weights, DEEP_KINDS if deep else KINDS))
    def check(mutant: Mutant) -> None:
        run_one(by_name[mutant.base], mutant, tally, deep=deep)
        if progress_every and tally.mutants % progress_every == 0:
            print(f"  {tally.name}: {tally.mutants} mutants ...", file=sys.stderr, flush=True)

    if seed is not None:
        check = hypothesis.seed(seed)(check)
    previous = np.seterr(all="ignore")  # NaN weights are the mutants' business, not a warning
    began = time.perf_counter()
    try:
        check()
    finally:
        tally.wall += time.perf_counter() - began
        np.seterr(**previous)
