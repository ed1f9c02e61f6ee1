"""The control channel: authenticated frames of ``runplan.wire`` bytes. Bad input (garbage,
a stale or unknown run id, a message from the wrong peer) is refused and logged, and
the stage keeps serving its run."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from runplan import RunPlan, SamplingConfig
from runplan.config import Timeouts
from runplan.messages import StageReady, StopReason, StopRun
from runtime_cupy.api import plan_for
from runtime_cupy.control import (
    MAX_FRAME_BYTES,
    ControlChannel,
    FrameError,
    Incoming,
    Refused,
    decode_frame,
    encode_frame,
    new_key,
)
from runtime_cupy.launcher import ProcessRun
from tests.runtime_cupy.hygiene import run_resources

KEY = new_key()
STOP = StopRun("r", StopReason.CANCELLED)


def test_a_frame_round_trips_and_names_its_sender() -> None:
    msg = StageReady("run-1", 2, "stage-2")
    frame = encode_frame(KEY, "stage-2", "orchestrator", msg)
    assert frame.endswith(b"\n") and frame.count(b"\n") == 1
    assert decode_frame(KEY, "orchestrator", frame[:-1]) == Incoming("stage-2", msg)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"", "not a frame"),
        (b"\x00\xff garbage \x01", "not a frame"),
        (b"ab cd {}", "not a frame"),
        (encode_frame(new_key(), "orchestrator", "stage-0", STOP), "bad MAC"),  # another key
        (encode_frame(KEY, "orchestrator", "stage-1", STOP), "bad MAC"),  # for another node
    ],
)  # fmt: skip
def test_what_is_not_an_authentic_frame_for_this_receiver_is_refused(
    line: bytes, reason: str
) -> None:
    with pytest.raises(FrameError, match=reason):
        decode_frame(KEY, "stage-0", line.rstrip(b"\n"))


def test_a_tampered_frame_is_refused() -> None:
    frame = encode_frame(KEY, "orchestrator", "stage-0", StopRun("run-1", StopReason.CANCELLED))
    with pytest.raises(FrameError, match="bad MAC"):
        decode_frame(KEY, "stage-0", frame[:-1].replace(b"run-1", b"run-2"))


def test_a_reader_resynchronises_after_garbage_and_over_long_lines() -> None:
    a, b = socket.socketpair()
    try:
        reader = ControlChannel(a, KEY, "stage-0", "orchestrator")
        writer = ControlChannel(b, KEY, "orchestrator", "stage-0")
        stop = StopRun("run-1", StopReason.COMPLETED)
        items: list[Incoming | Refused] = []

        def write() -> None:
            writer.send_raw(b"\x00garbage\n")
            writer.send_raw(b"x" * (MAX_FRAME_BYTES + 10) + b"\n")
            writer.send(stop)
            b.shutdown(socket.SHUT_WR)

        thread = threading.Thread(target=write)
        thread.start()
        deadline = time.monotonic() + 20
        while not reader.eof and time.monotonic() < deadline:
            items += reader.receive()
        thread.join(20)
        refused = [i for i in items if isinstance(i, Refused)]
        assert len(refused) == 2 and "not a frame" in refused[0].reason
        assert "over" in refused[1].reason
        assert items[-1] == Incoming("orchestrator", stop)  # the frame after them is read
    finally:
        a.close()
        b.close()


def test_bad_control_input_is_refused_logged_and_the_run_goes_on(tiny: str, tmp_path: Path) -> None:
    prompt = [4, 5, 6]
    timeouts = Timeouts(ready_ms=20_000, step_ms=20_000, edge_wait_ms=20_000, stop_ms=5_000)

    def new_plan() -> RunPlan:
        plan, _ = plan_for(
            tiny,
            stages=2,
            prompt_len=len(prompt),
            max_tokens=6,
            sampling=SamplingConfig(),
            return_logits=False,
            timeouts=timeouts,
        )
        return plan

    clean = ProcessRun(new_plan(), prompt).run()
    assert clean.finished is not None and clean.finished.outcome is StopReason.COMPLETED

    forged: list[int] = []

    def forge(token: int) -> None:  # on the first token: every stage is running
        if forged:
            return
        forged.append(token)
        for stage in run.stages:
            ch = stage.channel
            node = stage.node_id
            ch.send_raw(b"\x00\xff\xfe not a frame at all\n")
            ch.send_raw(b'{"type": "StopRun"}\n')  # wire bytes without a MAC
            previous = StopRun("run-previous", StopReason.CANCELLED)
            # The previous run's orchestrator: another secret.
            ch.send_raw(encode_frame(new_key(), "orchestrator", node, previous))
            # A run id that is not this stage's run, signed with this run's secret.
            ch.send_raw(encode_frame(run.key, "orchestrator", node, previous))
            # The wrong peer: a StopRun for this very run from another node.
            stop = StopRun(plan.run_id, StopReason.CANCELLED)
            ch.send_raw(encode_frame(run.key, "stage-9", node, stop))

    plan = new_plan()
    run = ProcessRun(plan, prompt, on_token=forge, log_dir=tmp_path)
    result = run.run()
    assert result.finished is not None
    assert result.finished.outcome is StopReason.COMPLETED  # nothing of it stopped the run
    assert result.tokens == clean.tokens and len(result.tokens) == 6
    assert all(s.returncode == 0 for s in result.stages)
    for stage in result.stages:
        log = (tmp_path / f"stage-{stage.stage_index}.log").read_text()
        assert log.count("refused a control frame") == 3, log
        assert log.count("not a frame") == 2 and log.count("bad MAC") == 1
        assert "authentic frame" not in log
        assert "rejected from 'orchestrator': UNKNOWN_RUN" in log
        assert "rejected from 'stage-9': UNAUTHORIZED_SENDER" in log
    assert run_resources(plan.run_id) == []
