"""A lost stage does not lose the answer (issue 25) on the process runtime: a warm chain
with ``recover=True`` whose stage process is SIGKILLed mid-stream is re-placed (the lost
stage started again on new links; the stages whose node and layers are unchanged keep
their process and bound weights and join the new chain's links), and each interrupted
run is replayed there: the caller's stream goes on and its whole text is the unbroken
run's, greedy and seeded, with 4 runs in flight, through a second loss during the
recovery, and through a spare lost while the new chain comes up; a stream whose
recoveries are spent ends with its fault naming ``--max-recoveries``. A kept stage's control
channel changes keys with the chain's secret: the old secret signs nothing on it any
more. Nothing of the old chain is left (the ``no_leftovers`` fixture checks every
chain's resources by its id, the old one's too), and the old run ids stay stale on the
kept stages.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runplan import NodeSpec
from runplan.messages import StopReason, StopRun
from runplan.provision import provision_all
from runtime_cupy import generate
from runtime_cupy.process.chain_run import ChainRun
from runtime_cupy.process.control_channel import encode_frame
from runtime_cupy.serve.chain import WarmChain
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.hosts import GatedHost, LosingHost, TapHost, UnjoinableHost
from tests.support.hygiene import alive, run_resources, wait_gone
from tests.support.servers import wait_for

pytestmark = pytest.mark.process

PROMPT = [5, 77, 30, 12, 9]
TOKENS = 16
STOP = StopRun("forged", StopReason.CANCELLED)
SEEDED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 11}


def kill_after(
    chain: WarmChain, stage: int, after: int, seen: list[int], signum: int = signal.SIGKILL
) -> Callable[[int], None]:
    """An ``on_token`` that records the stream and sends ``signum`` (SIGKILL) to
    ``stage``'s process once ``after`` tokens arrived (from the chain's loop thread:
    mid-stream)."""
    pids = chain.pids()

    def on_token(token: int) -> None:
        seen.append(token)
        if len(seen) == after:
            os.kill(pids[stage], signum)

    return on_token


def test_a_stage_that_ends_its_runs_on_its_own_is_a_lost_stage(tiny: str) -> None:
    """SIGTERM to stage 1 mid-stream (as another hand, or a Ray stage whose supervisor
    died, ends it): the stage takes its orchestrator for lost and ends, saying nothing
    more, so the chain recovers as from a killed stage. It once sent ``StageStopped``
    for its run first, a stage stopping unasked: a protocol violation, not recovered."""
    unbroken = generate(tiny, PROMPT, stages=3, max_tokens=TOKENS)
    with WarmChain(tiny, stages=3, context=64, recover=True) as chain:
        seen: list[int] = []
        run = chain.generate(
            PROMPT, max_tokens=TOKENS, on_token=kill_after(chain, 1, 3, seen, signal.SIGTERM)
        )
        assert run.result.outcome == "completed", run.result.fault
        assert run.result.tokens == unbroken.tokens and tuple(seen) == unbroken.tokens
        assert chain.recoveries.count == 1


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_a_stage_killed_mid_stream_is_replaced_and_the_others_keep_their_weights(
    tiny: str, tmp_path: Path, sampling: dict[str, Any]
) -> None:
    """Stage 1 of 3 SIGKILLed mid-stream: the stream goes on, token for token; stages 0
    and 2 keep their processes and bound weights (their logs: one bind each, then
    ``weights reused`` on the new chain), only stage 1 is started and binds anew; the
    old chain's links are gone (new secret, new names) while the kept stages serve;
    the interrupted run's id, sent to a kept stage again, is refused as stale."""
    unbroken = generate(tiny, PROMPT, stages=3, max_tokens=TOKENS, **sampling)
    assert unbroken.outcome == "completed" and len(unbroken.tokens) == TOKENS
    host = TapHost(log_dir=tmp_path)
    with WarmChain(tiny, stages=3, context=64, recover=True, host=host) as chain:
        pids, old_chain = chain.pids(), chain.chain_id
        seen: list[int] = []
        runs: list[ChainRun] = []
        run = chain.generate(
            PROMPT,
            max_tokens=TOKENS,
            on_token=kill_after(chain, 1, 3, seen),
            on_run=runs.append,
            **sampling,
        )
        assert run.result.outcome == "completed", run.result.fault
        assert run.result.tokens == unbroken.tokens
        assert run.result.text == unbroken.text
        assert tuple(seen) == unbroken.tokens, "the caller's stream went on, token for token"
        assert chain.recoveries.count == 1 and chain.recoveries.seconds > 0
        assert chain.ready
        now = chain.pids()
        assert (now[0], now[2]) == (pids[0], pids[2]), "the surviving stages kept their process"
        assert now[1] != pids[1] and not wait_gone([pids[1]], 10.0)
        assert chain.kept == (0, 2) and chain.restarts == 1
        assert chain.chain_id != old_chain, "a new secret: new link names and keys"
        assert run_resources(old_chain) == [], "the old chain's links are freed"
        # The interrupted run's provision and stop, signed as the orchestrator's, reach
        # kept stage 0: refused as stale, and the chain serves on.
        interrupted = runs[0].plan
        host.taps[0].forge_to_stage("orchestrator", provision_all(interrupted)[0])
        host.taps[0].forge_to_stage(
            "orchestrator", StopRun(interrupted.run_id, StopReason.CANCELLED)
        )
        # The old secret (the lost stage's process held it too) signs nothing on a kept
        # stage's control channel any more: the new chain re-keyed it.
        old_key = host.taps[0].keys[0]
        assert host.taps[0].key != old_key
        host.taps[0].to_stage(encode_frame(old_key, "orchestrator", "stage-0", 0, STOP))
        again = chain.generate(PROMPT, max_tokens=4, **sampling)
        assert again.result.tokens == unbroken.tokens[:4]
    assert (tmp_path / "stage-0.log").read_text().count("refused a control frame: bad MAC") == 1
    for kept in (0, 2):
        log = (tmp_path / f"stage-{kept}.log").read_text()
        assert log.count("bound weights in") == 1, "a kept stage bound its slice once"
        assert "joined chain generation 1" in log and log.count("weights reused") >= 2
    assert (tmp_path / "stage-0.log").read_text().count("STALE_RUN") == 2
    assert (tmp_path / "stage-1.log").read_text().count("bound weights in") == 2, (
        "the lost stage's range was bound twice: by the killed process and the new one"
    )


def test_a_kept_stage_that_cannot_join_is_stopped_and_reaped(tiny: str) -> None:
    """Stage 1 SIGKILLed mid-stream; stage 0 is kept, but its host cannot hand it the
    new chain's secret (a Ray supervisor that does not answer in time): the new chain's
    start fails, and the kept stage, handed over by the broken chain, is stopped, reaped
    and let go of with it (its handle was dropped unclosed: its lifeline's descriptor
    left open for the life of the process, its process neither stopped nor reaped, and
    on a Ray host its supervisor never released); the next start starts both stages and
    the stream goes on, token for token."""
    unbroken = generate(tiny, PROMPT, stages=2, max_tokens=TOKENS, **SEEDED)
    host = UnjoinableHost()
    with WarmChain(tiny, stages=2, context=64, recover=True, host=host) as chain:
        first = chain.pids()
        seen: list[int] = []
        run = chain.generate(
            PROMPT, max_tokens=TOKENS, on_token=kill_after(chain, 1, 2, seen), **SEEDED
        )
        assert run.result.outcome == "completed", run.result.fault
        assert run.result.tokens == unbroken.tokens and tuple(seen) == unbroken.tokens
        kept = host.started[0]
        assert kept.pid == first[0]
        assert kept in host.closed, "the kept stage that did not join was let go of"
        assert kept.proc.returncode is not None, "and reaped"
        assert not wait_gone([first[0]], 10.0)
        assert first[0] not in chain.pids() and chain.kept == ()


def test_a_chain_closed_while_a_recovery_starts_it_again_leaves_nothing(tiny: str) -> None:
    """``close()`` while a stream's recovery starts the new chain (its stage's start held
    at the host's gate): the new chain is stopped as it comes up and nothing of it is
    left (it came up after ``close()`` had found no chain to stop: its stage processes
    and links ran on under the closed chain), and the stream ends faulted, naming the
    close, not recoveries spent."""
    host = GatedHost({})
    chain = WarmChain(tiny, stages=2, context=64, recover=True, host=host)
    chain.start()
    try:
        first = chain.pids()
        seen: list[int] = []
        results: list[Any] = []

        def on_token(token: int) -> None:
            seen.append(token)
            if len(seen) == 2:
                host.hold()  # the recovery's start waits at the gate
                os.kill(first[1], signal.SIGKILL)

        stream = threading.Thread(
            target=lambda: results.append(
                chain.generate(PROMPT, max_tokens=TOKENS, on_token=on_token)
            )
        )
        stream.start()
        assert host.waiting.wait(60), "the recovery started no stage"
        chain.close()
    finally:
        host.release()
    stream.join(60)
    assert not stream.is_alive() and len(results) == 1
    result = results[0].result
    assert result.outcome == "faulted" and result.tokens == tuple(seen)
    assert (result.fault or "").endswith("; not recovered: the chain is closed"), result.fault
    assert chain.handles() == ()
    started = [handle.pid for handle in host.started]
    assert len(started) == 3 and not wait_gone(started, 10.0), "no stage process is left"


def test_a_stage_killed_between_tokens_without_recover_ends_the_run(tiny: str) -> None:
    """The control: the same kill without ``recover`` faults the run (as before)."""
    with WarmChain(tiny, stages=2, context=64) as chain:
        seen: list[int] = []
        run = chain.generate(PROMPT, max_tokens=TOKENS, on_token=kill_after(chain, 1, 3, seen))
        assert run.result.outcome == "faulted"
        assert "SIGKILL" in (run.result.fault or "")
        assert chain.recoveries.count == 0


def test_four_runs_in_flight_all_resume(tiny: str) -> None:
    prompts = [PROMPT, [9, 8, 7, 6], [40, 41, 42, 43, 44, 45], [3, 1, 4, 1, 5]]
    settings: list[dict[str, Any]] = [{}, SEEDED, {"temperature": 0.7, "seed": 3}, {}]
    unbroken = [
        generate(tiny, p, stages=3, max_tokens=2 * TOKENS, **s)
        for p, s in zip(prompts, settings, strict=True)
    ]
    with WarmChain(tiny, stages=3, context=64, recover=True, max_concurrent=4) as chain:
        pids = chain.pids()
        streams: list[list[int]] = [[] for _ in prompts]
        all_in = threading.Barrier(4)
        killed = threading.Event()
        lock = threading.Lock()

        def on_token(i: int) -> Callable[[int], None]:
            def record(token: int) -> None:
                streams[i].append(token)
                with lock:  # once every run has tokens out: all four are in flight
                    if not killed.is_set() and all(len(s) >= 2 for s in streams):
                        killed.set()
                        os.kill(pids[1], signal.SIGKILL)

            return record

        results: list[Any] = [None] * 4

        def one(i: int) -> None:
            all_in.wait()
            results[i] = chain.generate(
                prompts[i], max_tokens=2 * TOKENS, on_token=on_token(i), **settings[i]
            )

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert killed.is_set(), "the stage was killed with the four runs in flight"
        for i, want in enumerate(unbroken):
            got = results[i].result
            assert got.outcome == "completed", got.fault
            assert got.tokens == want.tokens, f"run {i}"
            assert tuple(streams[i]) == want.tokens, f"stream {i}"
        assert chain.recoveries.count == 4, "every run in flight was replayed"
        assert len(chain.recoveries.replacements) == 1, "one re-placement served them all"
        assert not alive(pids[1])


def test_a_second_loss_during_the_recovery(tiny: str) -> None:
    unbroken = generate(tiny, PROMPT, stages=2, max_tokens=TOKENS, **SEEDED)
    with WarmChain(tiny, stages=2, context=64, recover=True) as chain:
        first = chain.pids()
        seen: list[int] = []

        def on_token(token: int) -> None:
            seen.append(token)
            if len(seen) == 2:
                os.kill(first[1], signal.SIGKILL)
            if len(seen) == 4:  # the replay's second token: its chain is lost in turn
                os.kill(chain.pids()[0], signal.SIGKILL)

        run = chain.generate(PROMPT, max_tokens=TOKENS, on_token=on_token, **SEEDED)
        assert run.result.outcome == "completed", run.result.fault
        assert run.result.tokens == unbroken.tokens
        assert tuple(seen) == unbroken.tokens
        assert chain.recoveries.count == 2
        assert len(chain.recoveries.replacements) == 2


def test_a_recovery_is_counted_as_its_replays_first_token_arrives(tiny: str) -> None:
    """``Recoveries`` (``/metrics``' ``gguf_pipeline_recoveries_total``) counts a stream
    recovered once its replay's first token arrives, while the stream goes on: it was
    counted only once the replay ended (a scrape during a long recovered answer said
    none), and a replay that ended before any token was counted with its end taken for
    its first token."""
    with WarmChain(tiny, stages=2, context=64, recover=True) as chain:
        pids = chain.pids()
        seen: list[int] = []
        counted: list[int] = []

        def on_token(token: int) -> None:
            seen.append(token)
            counted.append(chain.recoveries.count)
            if len(seen) == 2:
                os.kill(pids[1], signal.SIGKILL)

        run = chain.generate(PROMPT, max_tokens=TOKENS, on_token=on_token)
        assert run.result.outcome == "completed", run.result.fault
        assert counted[:2] == [0, 0] and counted == sorted(counted) and counted[-1] == 1, counted
        (times,) = chain.recoveries.times
        assert times.ended_s <= times.bound_s <= times.first_token_s


def test_a_recovery_whose_replay_ends_well_with_no_token_is_counted(tmp_path: Path) -> None:
    """The stream's next token ends generation (an end-of-turn id, not delivered) and a
    stage is lost just before it: the replay ends completed with no token delivered; the
    stream was recovered all the same (counted, its end taken for its first token). It
    went uncounted once recoveries were counted at the replay's first token."""
    plain = write_model(tmp_path / "plain.gguf", ModelShape(n_layers=4))
    with WarmChain(str(plain), stages=2, context=64) as chain:
        tokens = chain.generate(PROMPT, max_tokens=TOKENS).result.tokens
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    ending = {"tokenizer.ggml.eot_token_id": int(tokens[k])}  # ends the stream after k
    model = write_model(tmp_path / "ending.gguf", ModelShape(n_layers=4), extra_keys=ending)
    with WarmChain(str(model), stages=2, context=64, recover=True) as chain:
        pids = chain.pids()
        seen: list[int] = []

        def on_token(token: int) -> None:
            seen.append(token)
            if len(seen) == k:
                os.kill(pids[1], signal.SIGKILL)
                assert not wait_gone([pids[1]], 30.0)

        run = chain.generate(PROMPT, max_tokens=TOKENS, on_token=on_token)
        assert run.result.outcome == "completed", run.result.fault
        assert run.result.tokens == tokens[:k] == tuple(seen)
        assert chain.pids()[1] != pids[1], "stage 1 started again: the stream was replayed"
        assert chain.recoveries.count == 1
        (times,) = chain.recoveries.times
        assert times.ended_s <= times.bound_s <= times.first_token_s


def test_recoveries_spent_end_the_stream_with_its_fault(tiny: str) -> None:
    with WarmChain(tiny, stages=2, context=64, recover=True, max_recoveries=1) as chain:
        first = chain.pids()
        seen: list[int] = []

        def on_token(token: int) -> None:
            seen.append(token)
            if len(seen) == 2:
                os.kill(first[1], signal.SIGKILL)
            if len(seen) == 4:
                os.kill(chain.pids()[1], signal.SIGKILL)

        run = chain.generate(PROMPT, max_tokens=TOKENS, on_token=on_token)
        assert run.result.outcome == "faulted"
        fault = run.result.fault or ""
        assert "SIGKILL" in fault
        assert fault.endswith("; not recovered: no recovery left (--max-recoveries 1)"), fault
        assert run.result.tokens == tuple(seen) and len(seen) >= 4
        assert chain.recoveries.count == 1


def _losing_n1_at_the_second_token(
    host: LosingHost, stage_pid: int, seen: list[int]
) -> Callable[[int], None]:
    """An ``on_token`` that keeps the tokens in ``seen`` and, at the second, loses node
    ``n1``'s host and kills its stage (``stage_pid``)."""

    def on_token(token: int) -> None:
        seen.append(token)
        if len(seen) == 2:
            host.lost.add("n1")
            os.kill(stage_pid, signal.SIGKILL)

    return on_token


def test_recoveries_spent_while_the_new_chain_starts_name_the_limit(tiny: str) -> None:
    """The last recovery's chain is lost while it starts (its spare's host gone as its
    stage comes up): the fault names what was lost then and the limit, as a recovery
    spent mid-run does (it named neither the limit nor its flag)."""
    host = LosingHost()
    memory = 8 << 30
    nodes = (NodeSpec("n0", memory), NodeSpec("n1", memory))
    spares = (NodeSpec("s0", memory), NodeSpec("s1", memory))
    with WarmChain(
        tiny, stages=2, context=64, recover=True, max_recoveries=1, host=host,
        nodes=nodes, spares=spares,
    ) as chain:  # fmt: skip
        pids = chain.pids()
        host.lose_on_start.add("s0")
        seen: list[int] = []
        on_token = _losing_n1_at_the_second_token(host, pids[1], seen)

        run = chain.generate(PROMPT, max_tokens=TOKENS, on_token=on_token)
        assert run.result.outcome == "faulted"
        fault = run.result.fault or ""
        assert "; not recovered: stage 1 (node 's0'" in fault, fault
        assert fault.endswith("; no recovery left (--max-recoveries 1)"), fault
        assert run.result.tokens == tuple(seen) and chain.recoveries.count == 0
        assert "s1" not in host.started_on  # no try past the limit


def test_a_spare_lost_while_the_new_chain_comes_up_is_passed_over(tiny: str) -> None:
    """Stage 1's node is lost mid-stream; its range goes to spare ``s0``, which is lost in
    turn the moment its stage starts (a host gone while its stage comes up and binds).
    The next try places the range again over the nodes still live (spare ``s1``), never
    on ``s0``, and the stream goes on, token for token."""
    unbroken = generate(tiny, PROMPT, stages=2, max_tokens=TOKENS, **SEEDED)
    host = LosingHost()
    memory = 8 << 30
    nodes = (NodeSpec("n0", memory), NodeSpec("n1", memory))
    spares = (NodeSpec("s0", memory), NodeSpec("s1", memory))
    with WarmChain(
        tiny, stages=2, context=64, recover=True, host=host, nodes=nodes, spares=spares
    ) as chain:
        pids = chain.pids()
        host.lose_on_start.add("s0")
        seen: list[int] = []
        on_token = _losing_n1_at_the_second_token(host, pids[1], seen)

        run = chain.generate(PROMPT, max_tokens=TOKENS, on_token=on_token, **SEEDED)
        assert run.result.outcome == "completed", run.result.fault
        assert run.result.tokens == unbroken.tokens
        assert tuple(seen) == unbroken.tokens
        assert [s.node_id for s in chain.template.stages] == ["n0", "s1"]
        assert "s0" not in host.started_on[host.started_on.index("s0") + 1 :]


def test_a_node_lost_while_the_chain_is_idle_is_placed_again_before_the_next_run(
    tiny: str,
) -> None:
    """Stage 1's node lost with no run in flight: the next request finds the chain
    placed again on the spare, keeping the other stages (it once started the same plan
    again, failed on the gone node, and only the request after it was placed again)."""
    unbroken = generate(tiny, PROMPT, stages=3, max_tokens=TOKENS)
    host = LosingHost()
    memory = 8 << 30
    nodes = (NodeSpec("n0", memory), NodeSpec("n1", memory), NodeSpec("n2", memory))
    with WarmChain(
        tiny, stages=3, context=64, recover=True, host=host, nodes=nodes,
        spares=(NodeSpec("s0", memory),),
    ) as chain:  # fmt: skip
        pids = chain.pids()
        host.lost.add("n1")
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: not chain.ready, 10.0, "the chain to see its loss")
        run = chain.generate(PROMPT, max_tokens=TOKENS)
        assert run.result.outcome == "completed", run.result.fault
        assert run.result.tokens == unbroken.tokens
        assert [s.node_id for s in chain.template.stages] == ["n0", "s0", "n2"]
        assert host.started_on == ["n0", "n1", "n2", "s0"], "the others were kept"


def test_a_request_that_comes_just_after_a_loss_waits_for_the_recovery(tiny: str) -> None:
    """Stage 1 killed mid-stream, and another request made at once (before the chain's
    fault has ended the stream's run): it waits while the stream recovers, then runs on
    the new chain (it once failed at once: "the chain is not up")."""
    unbroken = generate(tiny, PROMPT, stages=2, max_tokens=TOKENS)
    with WarmChain(tiny, stages=2, context=64, recover=True) as chain:
        pids = chain.pids()
        late: list[Any] = []

        def request() -> None:
            while chain.ready:  # from the moment the chain knows it is broken
                time.sleep(0)
            try:
                late.append(chain.generate(PROMPT, max_tokens=TOKENS))
            except Exception as exc:
                late.append(exc)

        seen: list[int] = []
        thread = threading.Thread(target=request)

        def on_token(token: int) -> None:
            seen.append(token)
            if len(seen) == 3:
                os.kill(pids[1], signal.SIGKILL)
                thread.start()

        run = chain.generate(PROMPT, max_tokens=TOKENS, on_token=on_token)
        thread.join(120)
        assert run.result.outcome == "completed", run.result.fault
        assert run.result.tokens == unbroken.tokens
        (other,) = late
        assert not isinstance(other, Exception), other
        assert other.result.outcome == "completed", other.result.fault
        assert other.result.tokens == unbroken.tokens


def test_a_chain_with_logprobs_hands_over_every_tokens_logits_across_a_recovery(
    tiny: str,
) -> None:
    """``logprobs``: the stream's every token comes with its logits, the replay's tokens
    on the re-placed chain too (its plans still return them: one kind of token record
    for the chain, before and after), and the same logits as the unbroken run's."""
    with WarmChain(tiny, stages=2, context=64, logprobs=True) as chain:
        unbroken: list[np.ndarray] = []
        whole = chain.generate(PROMPT, max_tokens=TOKENS, on_logits=unbroken.append)
        assert whole.result.outcome == "completed" and len(unbroken) == TOKENS
    with WarmChain(tiny, stages=2, context=64, recover=True, logprobs=True) as chain:
        seen: list[int] = []
        logits: list[np.ndarray] = []
        run = chain.generate(
            PROMPT,
            max_tokens=TOKENS,
            on_token=kill_after(chain, 1, 3, seen),
            on_logits=logits.append,
        )
        assert run.result.outcome == "completed", run.result.fault
        assert chain.recoveries.count == 1
        assert run.result.tokens == whole.result.tokens and len(logits) == TOKENS
        for got, want in zip(logits, unbroken, strict=True):
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        again: list[np.ndarray] = []
        assert (
            chain.generate(PROMPT, max_tokens=4, on_logits=again.append).result.tokens
            == (whole.result.tokens[:4])
        )
        assert len(again) == 4


def test_a_stage_frame_that_cannot_be_read_is_not_recovered(tiny: str, tmp_path: Path) -> None:
    """A frame signed as stage 1's whose message does not parse (another version, a
    defect): the chain faults with a protocol violation, which recovery does not retry
    (a stage placed again would speak the same): the run ends faulted naming the frame,
    no stage is placed again."""
    host = TapHost(log_dir=tmp_path)
    with WarmChain(tiny, stages=2, context=64, recover=True, host=host) as chain:
        forged: list[int] = []

        def on_token(token: int) -> None:
            if not forged:
                forged.append(token)
                host.taps[1].forge_to_orchestrator("stage-1", b"\xff not json")

        run = chain.generate(PROMPT, max_tokens=50, on_token=on_token)
        assert forged
        assert run.result.outcome == "faulted"
        assert "could not be read" in (run.result.fault or ""), run.result.fault
        assert chain.recoveries.count == 0 and chain.restarts == 0  # nothing placed again
