"""The runs of a warm chain (``serve.chain.WarmChain``, whose base ``ChainRuns`` is):
``generate`` (one run, waited for), ``submit`` (one run handed to the chain, returned at
once), a replay's ``submit_replay``, and what an ended run gave (``result``, a
``WarmResult``); with ``recover=True`` a run is a stream that a lost stage does not end
(``serve.recovery.run_stream``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
from attrs import frozen

from runplan import RunPlan, SamplingConfig
from runtime_core.recovery import RecoveryPolicy
from runtime_core.replay import Replay
from runtime_core.tokenizer import Tokenizer
from runtime_cupy.api import GenerateResult, summarize
from runtime_cupy.process.chain_run import ChainRun, OnLogits
from runtime_cupy.process.chain_runner import ChainRunner
from runtime_cupy.process.launcher import run_result
from runtime_cupy.process.names import run_label
from runtime_cupy.serve.chain_errors import ChainError
from runtime_cupy.serve.recovery import Replacer, run_stream

if TYPE_CHECKING:
    from runtime_cupy.serve.chain import WarmChain

# The warm chain's: its log lines keep their logger.
log = logging.getLogger("runtime_cupy.serve.chain")

#: How long a run waits for a chain broken under runs in flight to be whole again: the
#: fault ends those runs within a stop's bound, and their streams' recovery (a new
#: chain started and bound) holds the chain's heal lock, which the wait takes too.
HEAL_WAIT_S = 60.0
#: ``on_run(run)``: the run about to start, for its caller to cancel.
OnRun = Callable[[ChainRun], None]


@frozen
class WarmResult:
    """One run on the warm chain: ``result`` as ``runtime_cupy.generate`` returns it,
    ``started_s`` and ``first_token_s`` on the monotonic clock (run start to its
    first token: provisioning, barrier, prefill), and the stages started again before
    the run (``restarted``, by index)."""

    result: GenerateResult
    prompt_tokens: int
    started_s: float
    first_token_s: float | None
    restarted: tuple[int, ...] = ()

    @property
    def ttft_s(self) -> float | None:
        """Time to first token from the start of the run."""
        return None if self.first_token_s is None else self.first_token_s - self.started_s


def _drop_logits(logits: Any) -> None:
    """A run's logits that nobody takes."""


def check_callbacks(**callbacks: object) -> None:
    """``TypeError`` naming a callback given that cannot be called (``on_token=5`` once
    started its run, which its first token then cancelled)."""
    for name, callback in callbacks.items():
        if callback is not None and not callable(callback):
            raise TypeError(f"{name} must be callable or None, not {callback!r}")


class ChainRuns:
    """The runs of a ``WarmChain``, its base: what they take of the chain is set by
    ``WarmChain.__init__``."""

    tokenizer: Tokenizer
    logprobs: bool
    policy: RecoveryPolicy | None
    replacer: Replacer
    _run_ids: Callable[[], str]
    _heal_lock: threading.RLock
    _runner: ChainRunner | None
    _warm: bool
    _closed: bool

    if TYPE_CHECKING:

        @property
        def ready(self) -> bool: ...

        @property
        def trouble(self) -> str | None: ...

        @trouble.setter
        def trouble(self, why: str | None) -> None: ...

        @property
        def in_flight(self) -> int: ...

        def _heal(self, lost: str | None = None) -> tuple[int, ...]: ...

        def _not_on_chain_thread(self, call: str) -> None: ...

        def _in_owner(self, call: str) -> None: ...

        def plan(
            self,
            run_id: str,
            *,
            max_tokens: int,
            sampling: SamplingConfig,
            prompt_tokens: int = 0,
        ) -> RunPlan: ...

    def run_id(self) -> str:
        """A new run id."""
        return self._run_ids()

    def submit_replay(
        self,
        replay: Replay,
        on_token: Callable[[int], None],
        on_logits: OnLogits | None = None,
    ) -> ChainRun:
        """Hand the chain the replay of an interrupted run (``ChainError`` when the chain
        is not up); ``on_logits``: its tokens' raw logits, as ``submit``'s."""
        self._in_owner("submit_replay")
        runner = self._runner
        if runner is None or not self.ready:
            raise ChainError(self.trouble or "the chain is not up")
        plan = self.plan(
            replay.run_id,
            max_tokens=replay.max_tokens,
            sampling=replay.sampling,
            prompt_tokens=len(replay.prompt),
        )
        log.info(
            "run %s replays %s", run_label(replay.run_id), run_label(replay.interrupted_run_id)
        )
        return runner.submit(plan, replay.prompt, on_token, on_logits=self._logits_to(on_logits))

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        on_token: Callable[[int], None] | None = None,
        on_run: OnRun | None = None,
        on_logits: OnLogits | None = None,
    ) -> WarmResult:
        """One run of ``prompt_ids`` on the chain (any thread; it joins the runs in
        flight). Raises ``ChainError`` when the chain is not up, and what the chain
        raises for a prompt it cannot run (``PromptError``) and the planner for settings
        it refuses (``PlanRejected``); a run that faults or is cancelled returns with
        that outcome. ``on_logits``: each token's raw logits (before temperature, top-k
        and top-p), just before its ``on_token``; the result then holds none.
        ``on_token`` and ``on_logits`` run on the chain's thread: one that raises
        (``KeyboardInterrupt`` and ``SystemExit`` included) ends its run alone, cancelled,
        and ``generate`` raises it again in its caller's thread. From the chain's thread
        (in a callback) it raises ``ChainError`` at once: it would wait for the thread it
        runs on (``submit`` does not wait). Whatever ends the call early (Ctrl-C, an
        ``on_run`` that raises) cancels the run."""
        self._not_on_chain_thread("generate")
        check_callbacks(on_token=on_token, on_run=on_run, on_logits=on_logits)
        if self._closed:
            raise ChainError("the chain is closed")
        restarted = self._whole_again()
        if not self.ready:
            raise ChainError(self.trouble or "the chain is not up")
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        outcome = self._run(tuple(prompt_ids), max_tokens, sampling, on_token, on_run, on_logits)
        return attrs.evolve(outcome, restarted=restarted)

    def _whole_again(self) -> tuple[int, ...]:
        """Before a run: a chain broken while no run is in flight starts again (the
        stage indices started); one broken with runs in flight, which its fault is
        ending (and their streams may recover), is waited for, for ``HEAL_WAIT_S`` at
        most: a request that came just after a loss once failed at once ("the chain
        is not up") while the streams in flight recovered."""
        deadline = time.monotonic() + HEAL_WAIT_S
        while True:
            with self._heal_lock:
                if self.ready or self._closed:
                    return ()
                if self.in_flight == 0:
                    return self._heal()
            if time.monotonic() >= deadline:
                return ()
            time.sleep(0.02)

    def _run(
        self,
        prompt: tuple[int, ...],
        max_tokens: int,
        sampling: SamplingConfig,
        on_token: Callable[[int], None] | None,
        on_run: OnRun | None,
        on_logits: OnLogits | None = None,
    ) -> WarmResult:
        if self.policy is not None and self._warm:
            chain = cast("WarmChain", self)  # a ChainRuns is a WarmChain's base
            return run_stream(
                chain, self.policy, prompt, max_tokens, sampling, on_token, on_run, on_logits
            )
        began = time.perf_counter()
        run = self.submit(
            prompt, max_tokens=max_tokens, sampling=sampling, on_token=on_token, on_logits=on_logits
        )
        run.wait_for_caller(on_run)
        return self.result(run, time.perf_counter() - began)

    def submit(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        sampling: SamplingConfig,
        on_token: Callable[[int], None] | None = None,
        on_done: Callable[[ChainRun], None] | None = None,
        on_logits: OnLogits | None = None,
    ) -> ChainRun:
        """Hand one run to the chain and return at once (any thread): ``run.wait()``,
        then ``result(run)``. ``on_done(run)`` when it ended (from the chain's thread).
        Raises ``ChainError`` when the chain is not up, ``PlanRejected`` for settings the
        planner refuses, ``TypeError`` for a callback that cannot be called; in a forked
        child of the process that made the chain, ``ChainError`` naming that process."""
        self._in_owner("submit")
        check_callbacks(on_token=on_token, on_done=on_done, on_logits=on_logits)
        runner = self._runner
        if runner is None:
            raise ChainError(self.trouble or "the chain is not up")
        plan = self.plan(
            self._run_ids(),
            max_tokens=max_tokens,
            sampling=sampling,
            prompt_tokens=len(prompt),
        )
        return runner.submit(
            plan, prompt, on_token, on_done=on_done, on_logits=self._logits_to(on_logits)
        )

    def _logits_to(self, on_logits: OnLogits | None) -> OnLogits | None:
        """Where a run's logits go: ``on_logits``; on a chain whose tokens come with
        logits (``logprobs``), nowhere for a run that does not take them (kept, a long
        answer's would fill the memory)."""
        if on_logits is not None and not self.logprobs:
            raise ValueError(
                "the chain was started without logprobs: its tokens come without logits"
            )
        if on_logits is None and self.logprobs:
            return _drop_logits
        return on_logits

    def result(self, run: ChainRun, wall_s: float | None = None) -> WarmResult:
        """What an ended run gave (``wait`` raises what refused it: ``PromptError``)."""
        outcome = run.wait()
        assert outcome is not None
        runner = run.runner
        wall = wall_s if wall_s is not None else outcome.ended_s - outcome.submitted_s
        result = summarize(run.plan, run_result(runner, outcome), self.tokenizer, wall, False)
        if runner.dead is not None and self.replacer.placeable:
            self.trouble = result.fault or runner.dead
        times = outcome.token_times_s
        return WarmResult(
            result=result,
            prompt_tokens=len(run.prompt),
            started_s=outcome.submitted_s,
            first_token_s=times[0] if times else None,
        )
