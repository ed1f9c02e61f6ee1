"""The orchestrator machine's value: what one run's machine holds, the bounds on its
token and its teardown, and the check of the prompt a machine is made for
(``PromptError``)."""

from __future__ import annotations

from attrs import frozen

from runplan.config import Timeouts, run_positions
from runplan.fsm.orchestrator_actions import Action
from runplan.fsm.orchestrator_events import Outcome, State
from runplan.messages import FaultReason, ProvisionStage
from runplan.plan import RunPlan
from runplan.provision import provision_all


@frozen
class OrchestratorMachine:
    state: State
    run_id: str
    node_ids: tuple[str, ...]  # stage index -> node id
    provisions: tuple[ProvisionStage, ...]
    prompt: tuple[int, ...]
    max_tokens: int
    end_token_ids: frozenset[int]  # EOS and the other ends of generation (the plan's)
    vocab_size: int
    timeouts: Timeouts
    provisioned: frozenset[int] = frozenset()
    ready: frozenset[int] = frozenset()
    endpoints_ready: bool = False
    dead: frozenset[int] = frozenset()  # stages gone: died, or silent (and killed)
    stopped: frozenset[int] = frozenset()
    injected: int = -1  # last sequence injected
    consumed: tuple[int, ...] = ()  # token ids consumed, sequence order (EOS included)
    outcome: Outcome | None = None
    fault: FaultReason | None = None
    fault_stage: int | None = None
    refused: frozenset[int] = frozenset()  # stages that refused the provision
    prefill_chunk: int = 0  # rows per chunk of the prompt (0: one record)
    token_restarts: int = 0  # times the token timer of ``injected`` started again
    token_runs: int = 1  # the most runs in flight while ``injected`` waited (TimerFired.runs)

    @classmethod
    def for_plan(cls, plan: RunPlan, prompt: tuple[int, ...]) -> OrchestratorMachine:
        """The machine of one run of ``plan`` on ``prompt``; ``PromptError`` if the
        prompt cannot be run (no tokens, an id outside the vocabulary, or more
        positions than the KV cache holds)."""
        check_prompt(plan, prompt)
        return cls(
            state=State.PLANNED,
            run_id=plan.run_id,
            node_ids=tuple(s.node_id for s in plan.stages),
            provisions=provision_all(plan),
            prompt=tuple(prompt),
            max_tokens=plan.max_tokens,
            end_token_ids=plan.model.end_token_ids,
            vocab_size=plan.model.vocab_size,
            timeouts=plan.timeouts,
            prefill_chunk=plan.prefill_chunk,
        )

    @property
    def tokens(self) -> tuple[int, ...]:
        """Generated tokens, the one that ended the run (EOS, end of turn) excluded."""
        return tuple(t for t in self.consumed if not self.ends_run(t))

    def ends_run(self, token_id: int) -> bool:
        """Whether ``token_id`` ends the run (not delivered): EOS or another end of
        generation."""
        return token_id in self.end_token_ids

    @property
    def awaiting_stop(self) -> frozenset[int]:
        return self.provisioned - self.dead - self.stopped - self.refused

    @property
    def prefill_chunks(self) -> int:
        """Records the prompt travels in."""
        size = self.prefill_chunk
        return 1 if size <= 0 else -(-len(self.prompt) // size)

    @property
    def batch_rows(self) -> int:
        """Rows of the largest batch the run's records may share on a stage (0: they
        run alone)."""
        return max((p.batch_rows for p in self.provisions), default=0)

    @property
    def shared_batches(self) -> int:
        """Batches a step of the run may wait through on a stage it shares (the most of
        any stage's, ``ProvisionStage.shared_batches``)."""
        return max((p.shared_batches for p in self.provisions), default=1)

    @property
    def token_restart_limit(self) -> int:
        """Times the token timer of one token may start again while the chain delivers
        other runs' tokens (``TimerFired.delivered``): the most runs the chain held in
        flight while the token waited, this one included (``TimerFired.runs``, kept in
        ``token_runs``; at least 1). A stage serves decode records in the order they
        were loaded, and prefill records so too, an owed one leading every other batch
        at most: each other run in flight puts its one decode record, or its prompt's
        next chunk, ahead of this run's before it is served, a batch or two each, while
        each bound counts at least 3 batches a stage (``shared_batches``). Past the
        limit the run faults ``TIMEOUT`` however many tokens other runs get (its record
        was lost): within ``runs + 1`` bounds of the token's injection, however short
        the runs' caches are (not the runs a stage's KV budget could hold of them)."""
        return max(1, self.token_runs)

    @property
    def prompt_record_rows(self) -> int:
        """Rows of the run's longest record: the prompt, or its first chunk."""
        chunked = self.prefill_chunks > 1
        return min(self.prefill_chunk, len(self.prompt)) if chunked else len(self.prompt)

    def _token_ms(self, sequence: int = 1) -> int:
        """The bound on one token (``Timeouts.token_limit_ms``): a step per stage, and
        for sequence 0 one more step per chunk after the first (the chunks pipeline
        through the stages), each within the limit of the rows of the longest record
        (the prompt, or its first chunk; a decoded token's record has one row) or, with
        other runs sharing the stages, of the largest batch, waiting through
        ``shared_batches`` batches a step. When it runs out while the chain delivered
        tokens to other runs, it starts again (``TimerFired.delivered``), at most
        ``token_restart_limit`` times a token."""
        stages = len(self.node_ids)
        if sequence != 0:
            return self.timeouts.token_limit_ms(stages, 1, 1, self.batch_rows, self.shared_batches)
        rows, chunks = self.prompt_record_rows, self.prefill_chunks
        batches = self.shared_batches
        return self.timeouts.token_limit_ms(stages, chunks, rows, self.batch_rows, batches)

    def _stop_ms(self) -> int:
        """The bound on the teardown (``Timeouts.stop_limit_ms``): each stage may be in
        a step of the run's longest record, or in a batch of the largest, when its
        ``StopRun`` comes."""
        return self.timeouts.stop_limit_ms(self.prompt_record_rows, self.batch_rows)


_Result = tuple[OrchestratorMachine, tuple[Action, ...]]


class PromptError(ValueError):
    """A prompt a run cannot take."""


def check_prompt(plan: RunPlan, prompt: tuple[int, ...]) -> None:
    """Raise ``PromptError`` unless every id is in the vocabulary and the prompt plus
    ``max_tokens - 1`` fed-back tokens fit the positions the run's stages reserve
    (``kv_positions``, within ``max_seq_len``)."""
    vocab = plan.model.vocab_size
    if not prompt:
        raise PromptError("the prompt has no tokens")
    for i, token in enumerate(prompt):
        if type(token) is not int or not 0 <= token < vocab:
            raise PromptError(
                f"prompt token {i} is {token!r}, outside the vocabulary 0..{vocab - 1}"
            )
    positions = run_positions(len(prompt), plan.max_tokens)
    if positions > plan.model.max_seq_len:
        raise PromptError(
            f"{len(prompt)} prompt tokens + {plan.max_tokens} tokens to generate need "
            f"{positions} positions; the plan's max_seq_len is {plan.model.max_seq_len}"
        )
    if positions > plan.kv_positions:
        raise PromptError(
            f"{len(prompt)} prompt tokens + {plan.max_tokens} tokens to generate need "
            f"{positions} positions; the run's stages reserve {plan.kv_positions} "
            "(RuntimeConfig.prompt_tokens)"
        )
