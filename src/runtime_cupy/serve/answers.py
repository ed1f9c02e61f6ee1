"""Runs to answers: a job's run on the warm chain (``Answers.run``), its tokens streamed
to the request's sink as pieces of text as they arrive (stop strings and log
probabilities with them), its end told as ``Finished`` or ``Failed``, and the request
counted in the metrics once its last choice has ended (``Tally``)."""

from __future__ import annotations

import logging
import time

from runtime_core.runs import PlanRejected
from runtime_cupy.serve.chain import ChainError, WarmChain, WarmResult
from runtime_cupy.serve.events import Event, Failed, Finished, Piece
from runtime_cupy.serve.jobs import SHUTTING_DOWN, Job
from runtime_cupy.serve.logprobs import AnswerLogprobs
from runtime_cupy.serve.metrics import Metrics
from runtime_cupy.serve.text import Answer

log = logging.getLogger("runtime_cupy.serve")


class Answers:
    """What becomes of ``chain``'s jobs: their events to their sinks, their outcomes to
    ``metrics``."""

    def __init__(self, chain: WarmChain, metrics: Metrics) -> None:
        self.chain = chain
        self.tokenizer = chain.tokenizer
        self.metrics = metrics

    def deliver(self, job: Job, event: Event) -> None:
        try:
            job.sink(event)
        except Exception:  # the request's side is gone (its loop closed): nothing to tell
            log.debug("request #%d: event not delivered", job.number, exc_info=True)

    def count(self, job: Job, outcome: str) -> None:
        """``job`` ended with ``outcome``: its request counts in the metrics once its
        last choice has ended (``Tally``)."""
        ended = job.tally.end(outcome)
        if ended is not None:
            request, answered = ended
            prompt = len(job.prepared.prompt_ids) if answered else 0
            self.metrics.request(job.prepared.request.endpoint, request, prompt_tokens=prompt)

    def finish(self, job: Job, outcome: str, event: Event | None, *, tokens: int = 0) -> None:
        log.info("request #%d (%s) finished: %s, %d tokens%s", job.number, job.label, outcome,
                 tokens, f" ({event.message})" if isinstance(event, Failed) else "")  # fmt: skip
        if outcome != "completed" and tokens:  # an answered choice's count in answered()
            self.metrics.generated(tokens)  # a choice left, stopped or faulted: its tokens
        self.count(job, outcome)
        if event is not None:
            self.deliver(job, event)

    def run(self, job: Job) -> None:
        p = job.prepared
        r = p.request
        answer = Answer(self.tokenizer, r.stop)
        times: list[float] = []
        answer_logprobs = AnswerLogprobs(r.logprobs)

        def on_token(token_id: int) -> None:
            if job.cancelled or answer.stopped:
                return
            times.append(time.monotonic())
            answer_logprobs.token(token_id, answer.text.chars)  # the text before it
            piece = answer.push(token_id)
            if piece:
                self.deliver(job, Piece(piece, answer_logprobs.take()))
            if answer.stopped:
                job._stop_early()

        try:
            run = self.chain.generate(
                p.prompt_ids,
                max_tokens=p.max_tokens,
                temperature=r.temperature,
                top_k=r.top_k,
                top_p=r.top_p,
                seed=p.seed,
                on_token=on_token,
                on_run=job._attach,
                on_logits=answer_logprobs.logits if r.logprobs is not None else None,
            )
        except ChainError as exc:  # ChainClosing too: handed over as it closed
            self.finish(job, "faulted", Failed(503, str(exc), "stages_unavailable"))
            return
        except (PlanRejected, ValueError) as exc:  # refused settings a check let through
            failed = Failed(400, str(exc), "invalid_value", "invalid_request_error")
            self.finish(job, "rejected", failed)
            return
        finally:
            job._detach()
        self._answer(job, run, answer, times, answer_logprobs)

    def _answer(
        self,
        job: Job,
        run: WarmResult,
        answer: Answer,
        times: list[float],
        answer_logprobs: AnswerLogprobs,
    ) -> None:
        result = run.result
        p = job.prepared
        if job.cancelled:
            self.finish(job, "cancelled", None, tokens=answer.tokens)
            return
        if job.stopped or result.outcome == "completed":
            rest = answer.finish(None if job.stopped else result.tokens)
            stopped = job.stopped or answer.stopped or len(result.tokens) < p.max_tokens
            tokens = answer.tokens if job.stopped else len(result.tokens)
            if rest:
                self.deliver(job, Piece(rest, answer_logprobs.take(tokens)))
            ttft = times[0] - job.arrived_s if times else None
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            self.metrics.answered(tokens, ttft, tpot)
            entries, unsent = answer_logprobs.counted(tokens)
            finished = Finished(answer.content, "stop" if stopped else "length",
                                len(p.prompt_ids), tokens, entries, unsent)  # fmt: skip
            self.finish(job, "completed", finished, tokens=tokens)
            return
        if result.outcome == "cancelled":
            failed = Failed(503, f"the run was cancelled: {SHUTTING_DOWN}", "shutting_down")
            self.finish(job, "cancelled", failed, tokens=answer.tokens)  # those it was sent
            return
        failed = Failed(500, f"the pipeline failed: {result.fault}", "pipeline_fault")
        self.finish(job, "faulted", failed, tokens=answer.tokens)
