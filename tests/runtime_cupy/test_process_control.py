"""The control channel: authenticated, numbered frames of ``runplan.wire`` bytes. Bad input
(garbage, a frame of another run, another stage or a forger, a replayed or reordered
frame, a stale or unknown run id, a message from the wrong peer) is refused and logged,
and the stage and the orchestrator keep serving their run."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runplan import RunPlan, SamplingConfig
from runplan.config import Timeouts
from runplan.messages import FaultKind, JoinChain, StageReady, StopReason, StopRun
from runtime_cupy.api import plan_for
from runtime_cupy.process.control_channel import (
    MAX_FRAME_BYTES,
    ControlChannel,
    FrameError,
    Incoming,
    Refused,
    Unreadable,
    decode_frame,
    encode_frame,
    encode_payload,
)
from runtime_cupy.process.keys import BadSecret, control_key, new_secret, parse_secret
from runtime_cupy.process.launcher import ProcessRun
from tests.runtime_cupy.test_kill_orchestrator import ROOT
from tests.support.hosts import TapHost
from tests.support.hygiene import run_resources, wait_gone

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

KEY = control_key(new_secret(), "stage-0")
STOP = StopRun("r", StopReason.CANCELLED)


def test_a_frame_round_trips_and_names_its_sender_and_number() -> None:
    msg = StageReady("run-1", 2, "stage-2")
    frame = encode_frame(KEY, "stage-2", "orchestrator", 7, msg)
    assert frame.endswith(b"\n") and frame.count(b"\n") == 1
    assert decode_frame(KEY, "orchestrator", frame[:-1]) == (7, Incoming("stage-2", msg))


def test_each_stage_has_its_own_key() -> None:
    secret = new_secret()
    assert control_key(secret, "stage-0") != control_key(secret, "stage-1")
    assert control_key(secret, "stage-0") == control_key(secret, "stage-0")
    assert control_key(new_secret(), "stage-0") != control_key(secret, "stage-0")


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"", "not a frame"),
        (b"\x00\xff garbage \x01", "not a frame"),
        (b"ab cd 0 {}", "not a frame"),
        (b"ab cd -1 {}", "not a frame"),
        (encode_frame(control_key(new_secret(), "stage-0"), "orchestrator", "stage-0", 0, STOP),
         "bad MAC"),  # another run's secret
        (encode_frame(control_key(new_secret(), "stage-1"), "orchestrator", "stage-0", 0, STOP),
         "bad MAC"),  # another stage's key
        (encode_frame(KEY, "orchestrator", "stage-1", 0, STOP), "bad MAC"),  # for another node
    ],
)  # fmt: skip
def test_what_is_not_an_authentic_frame_for_this_receiver_is_refused(
    line: bytes, reason: str
) -> None:
    with pytest.raises(FrameError, match=reason):
        decode_frame(KEY, "stage-0", line.rstrip(b"\n"))


def test_a_tampered_frame_is_refused() -> None:
    frame = encode_frame(KEY, "orchestrator", "stage-0", 3, StopRun("run-1", StopReason.CANCELLED))
    with pytest.raises(FrameError, match="bad MAC"):
        decode_frame(KEY, "stage-0", frame[:-1].replace(b"run-1", b"run-2"))
    with pytest.raises(FrameError, match="bad MAC"):  # its number changed
        decode_frame(KEY, "stage-0", frame[:-1].replace(b" 3 ", b" 4 "))


def _read_all(
    reader: ControlChannel, write: threading.Thread
) -> list[Incoming | Refused | Unreadable]:
    items: list[Incoming | Refused | Unreadable] = []
    write.start()
    deadline = time.monotonic() + 20
    while not reader.eof and time.monotonic() < deadline:
        time.sleep(0.001)
        items += reader.receive()
    write.join(20)
    return items


def test_a_reader_resynchronises_after_garbage_and_over_long_lines() -> None:
    a, b = socket.socketpair()
    try:
        reader = ControlChannel(a, KEY, "stage-0", "orchestrator")
        stop = StopRun("run-1", StopReason.COMPLETED)

        def write() -> None:
            b.sendall(b"\x00garbage\n")
            b.sendall(b"x" * (MAX_FRAME_BYTES + 10) + b"\n")
            b.sendall(encode_frame(KEY, "orchestrator", "stage-0", 0, stop))
            b.shutdown(socket.SHUT_WR)

        items = _read_all(reader, threading.Thread(target=write))
        refused = [i for i in items if isinstance(i, Refused)]
        assert len(refused) == 2 and "not a frame" in refused[0].reason
        assert "over" in refused[1].reason
        assert items[-1] == Incoming("orchestrator", stop)  # the frame after them is read
    finally:
        a.close()
        b.close()


def test_replayed_and_reordered_frames_are_refused_and_the_next_one_is_read() -> None:
    a, b = socket.socketpair()
    try:
        reader = ControlChannel(a, KEY, "stage-0", "orchestrator")
        frames = [
            encode_frame(
                KEY, "orchestrator", "stage-0", n, StopRun(f"run-{n}", StopReason.CANCELLED)
            )
            for n in range(4)
        ]

        def write() -> None:
            b.sendall(frames[0])
            b.sendall(frames[0])  # captured and sent again
            b.sendall(frames[2])  # ahead of frame 1: reordered
            b.sendall(frames[1])
            b.sendall(frames[1])  # again
            b.sendall(frames[2])
            b.sendall(frames[3])
            b.shutdown(socket.SHUT_WR)

        items = _read_all(reader, threading.Thread(target=write))
        accepted = [i.message for i in items if isinstance(i, Incoming)]
        assert [m.run_id for m in accepted if isinstance(m, StopRun)] == [
            "run-0", "run-1", "run-2", "run-3"
        ]  # fmt: skip
        refused = [i.reason for i in items if isinstance(i, Refused)]
        assert refused == [
            "replayed frame: number 0, expected 1",
            "out of order frame: number 2, expected 1",
            "replayed frame: number 1, expected 2",
        ]
    finally:
        a.close()
        b.close()


def test_an_authentic_frame_that_does_not_parse_is_unreadable_and_takes_its_number() -> None:
    """Only the peer could sign it: it is handed on as ``Unreadable`` (the owner ends the
    peer), and the frames after it are read, not refused as out of order."""
    a, b = socket.socketpair()
    try:
        reader = ControlChannel(a, KEY, "stage-0", "orchestrator")
        stops = [StopRun(f"run-{n}", StopReason.CANCELLED) for n in range(3)]

        def write() -> None:
            b.sendall(encode_frame(KEY, "orchestrator", "stage-0", 0, stops[0]))
            b.sendall(encode_payload(KEY, "orchestrator", "stage-0", 1, b'{"type":"Nope"}'))
            b.sendall(encode_payload(KEY, "orchestrator", "stage-0", 1, b"again"))  # replayed
            b.sendall(encode_frame(KEY, "orchestrator", "stage-0", 2, stops[2]))
            other = control_key(new_secret(), "stage-0")  # a stranger's key
            b.sendall(encode_payload(other, "orchestrator", "stage-0", 3, b"x"))
            b.shutdown(socket.SHUT_WR)

        items = _read_all(reader, threading.Thread(target=write))
        assert items[0] == Incoming("orchestrator", stops[0])
        assert isinstance(items[1], Unreadable) and items[1].sender == "orchestrator"
        assert "malformed message" in items[1].reason
        assert items[2] == Refused("replayed frame: number 1, expected 2")
        assert items[3] == Incoming("orchestrator", stops[2])
        assert isinstance(items[4], Refused) and "bad MAC" in items[4].reason
        assert len(items) == 5
    finally:
        a.close()
        b.close()


def _settled(channel: ControlChannel) -> list[Incoming | Refused]:
    """What ``channel`` reads of what was written to it (a socket pair: at once)."""
    time.sleep(0.05)
    return channel.receive()


def test_a_chain_joined_changes_the_control_key_and_the_old_secret_signs_nothing() -> None:
    """``JoinChain`` re-keys the channel: the frames after it (read with it in one go)
    are decoded with the new chain's key once the stage has it; a frame signed with the
    old key (which the lost host's processes also held) is refused by the stage from
    then on, and by the orchestrator once the stage's first frame under the new key
    came; the numbering goes on."""
    old_secret, new = new_secret(), new_secret()
    old_key, new_key = control_key(old_secret, "stage-0"), control_key(new, "stage-0")
    a, b = socket.socketpair()
    try:
        orch = ControlChannel(a, old_key, "orchestrator", "stage-0")
        stage = ControlChannel(b, old_key, "stage-0", "orchestrator")
        stage.send(STOP)  # sent before the stage heard of the join: the old key
        join = JoinChain("stage-0", 0, 2, "shm", "shm", generation=1)
        orch.send_join(join, new_key)
        orch.send(StopRun("after", StopReason.CANCELLED))  # the new key
        got = _settled(stage)
        assert [i.message for i in got if isinstance(i, Incoming)] == [join]
        assert stage.rekey_due and _settled(stage) == [], "held until the stage has the key"
        stage.rekey(new_key)
        assert stage.buffered() == [
            Incoming("orchestrator", StopRun("after", StopReason.CANCELLED))
        ]
        assert orch.receive() == [Incoming("stage-0", STOP)], "the old key, before the first new"
        # a forger with the old secret, numbered as the stage expects next
        b2 = encode_frame(old_key, "orchestrator", "stage-0", 2, STOP)
        a.sendall(b2)
        (refused,) = _settled(stage)
        assert isinstance(refused, Refused) and "bad MAC" in refused.reason
        stage.send(StopRun("joined", StopReason.CANCELLED))  # the new key, number 1
        assert orch.receive() == [Incoming("stage-0", StopRun("joined", StopReason.CANCELLED))]
        b.sendall(encode_frame(old_key, "stage-0", "orchestrator", 2, STOP))
        (refused,) = _settled(orch)
        assert isinstance(refused, Refused) and "bad MAC" in refused.reason
        stage.send(STOP)
        assert orch.receive() == [Incoming("stage-0", STOP)], "the real number 2 still comes"
    finally:
        a.close()
        b.close()


def test_a_stage_that_cannot_join_keeps_its_key() -> None:
    a, b = socket.socketpair()
    try:
        orch = ControlChannel(a, KEY, "orchestrator", "stage-0")
        stage = ControlChannel(b, KEY, "stage-0", "orchestrator")
        a.sendall(
            encode_frame(
                KEY, "orchestrator", "stage-0", 0, JoinChain("stage-0", 0, 2, "shm", "shm", 1)
            )
        )
        a.sendall(encode_frame(KEY, "orchestrator", "stage-0", 1, STOP))
        assert len(_settled(stage)) == 1 and stage.rekey_due
        stage.keep_key()
        assert stage.buffered() == [Incoming("orchestrator", STOP)]
        with pytest.raises(ValueError, match="a control key has 32 bytes, not 3"):
            orch.send_join(JoinChain("stage-0", 0, 2, "shm", "shm", 1), b"key")
    finally:
        a.close()
        b.close()


def test_a_send_to_a_peer_that_does_not_read_never_blocks() -> None:
    a, b = socket.socketpair()
    try:
        writer = ControlChannel(a, KEY, "orchestrator", "stage-0")
        big = StopRun("r" * 60, StopReason.CANCELLED)

        def send_all() -> None:
            for _ in range(20_000):  # far more than the socket buffers hold
                writer.send(big)

        # A send that waited for the reader would wait for ever: the sends are bounded
        # as a hang, not timed (under 5 s once; 2.5 s of it on a loaded 2-core host).
        sender = threading.Thread(target=send_all, daemon=True)
        sender.start()
        sender.join(60)
        assert not sender.is_alive(), "a send waited for the reader"
        assert writer.wants_write  # the rest waits for the loop to see the socket writable
    finally:
        a.close()
        b.close()


def _plan(tiny: str, prompt: list[int], *, max_tokens: int = 6, bound_ms: int = 20_000) -> RunPlan:
    """Two stages; ``bound_ms`` the ready, step and edge bounds (the stop bound 5 s)."""
    timeouts = Timeouts(ready_ms=bound_ms, step_ms=bound_ms, edge_wait_ms=bound_ms, stop_ms=5_000)
    plan, _ = plan_for(
        tiny,
        stages=2,
        prompt_len=len(prompt),
        max_tokens=max_tokens,
        sampling=SamplingConfig(),
        return_logits=False,
        timeouts=timeouts,
    )
    return plan


def test_bad_control_input_is_refused_logged_and_the_run_goes_on(
    tiny: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = [4, 5, 6]
    clean = ProcessRun(_plan(tiny, prompt), prompt).run()
    assert clean.finished is not None and clean.finished.outcome is StopReason.COMPLETED

    forged: list[int] = []
    host = TapHost(log_dir=tmp_path)
    plan = _plan(tiny, prompt)

    def forge(token: int) -> None:  # on the first token: every stage is running
        if forged:
            return
        forged.append(token)
        secret = host.secret
        for index, tap in host.taps.items():
            node = plan.stages[index].node_id
            key = control_key(secret, node)
            previous = StopRun("run-previous", StopReason.CANCELLED)
            tap.to_stage(b"\x00\xff\xfe not a frame at all\n")
            tap.to_stage(b'{"type": "StopRun"}\n')  # wire bytes without a MAC
            # The previous run's orchestrator: another secret.
            tap.to_stage(
                encode_frame(control_key(new_secret(), node), "orchestrator", node, 1, previous)
            )
            # A frame for the other stage, sent on this stage's channel.
            other = plan.stages[1 - index].node_id
            tap.to_stage(
                encode_frame(control_key(secret, other), "orchestrator", node, 1, previous)
            )
            # The provision this stage got, captured on the wire and sent again.
            assert len(tap.sent_to_stage) == 1
            tap.to_stage(tap.sent_to_stage[0])
            # A frame signed with this stage's key, but numbered past the next one.
            tap.to_stage(encode_frame(key, "orchestrator", node, 5, previous))
            # Frames that pass the channel and reach the state machine: a run id that is
            # not this stage's run, and a StopRun for this very run from another node.
            tap.forge_to_stage("orchestrator", previous)
            tap.forge_to_stage("stage-9", StopRun(plan.run_id, StopReason.CANCELLED))
            # To the orchestrator: the stage's StageReady, captured and sent again.
            assert len(tap.sent_to_orchestrator) == 1
            tap.to_orchestrator(tap.sent_to_orchestrator[0])

    run = ProcessRun(plan, prompt, on_token=forge, host=host)
    with caplog.at_level(logging.WARNING, logger="runtime_cupy.process.launcher"):
        result = run.run()
    assert forged, "the run never got to its first token"
    assert result.finished is not None
    assert result.finished.outcome is StopReason.COMPLETED  # nothing of it stopped the run
    assert result.tokens == clean.tokens and len(result.tokens) == 6
    assert all(s.returncode == 0 for s in result.stages)  # each stopped on its StopRun
    for stage in result.stages:
        log = (tmp_path / f"stage-{stage.stage_index}.log").read_text()
        assert log.count("refused a control frame") == 6, log
        assert log.count("not a frame") == 2 and log.count("bad MAC") == 2
        assert "replayed frame: number 0, expected 1" in log
        assert "out of order frame: number 5, expected 1" in log
        assert "authentic frame" not in log
        assert "rejected from 'orchestrator': UNKNOWN_RUN" in log
        assert "rejected from 'stage-9': UNAUTHORIZED_SENDER" in log
    replays = [r for r in caplog.records if "replayed frame: number 0, expected 1" in r.message]
    assert len(replays) == 2  # the orchestrator refused each stage's StageReady again
    for tap in host.taps.values():
        tap.join(10)
    assert run_resources(result.chain_id) == []


@pytest.mark.parametrize("to", ["stage", "orchestrator"])
def test_an_unreadable_authentic_frame_ends_the_run_at_once_naming_it(
    tiny: str, tmp_path: Path, to: str
) -> None:
    """A frame only the peer could have signed whose message does not parse (another
    version, a defect): the run faults at once, naming it, not after its timeouts (the
    plan's step bound is 60 s); the stages exit and nothing of the run is left."""
    prompt = [4, 5, 6]
    host = TapHost(log_dir=tmp_path)
    plan = _plan(tiny, prompt, max_tokens=200, bound_ms=60_000)
    forged: list[float] = []

    def forge(token: int) -> None:  # on the first token: every stage is running
        if forged:
            return
        forged.append(time.monotonic())
        tap = host.taps[1]
        if to == "stage":
            tap.forge_to_stage("orchestrator", b'{"type":"FutureMessage","run_id":"x"}')
        else:
            tap.forge_to_orchestrator(plan.stages[1].node_id, b"\xff not json")

    result = ProcessRun(plan, prompt, on_token=forge, host=host).run()
    assert forged, "the run never got to its first token"
    ended = time.monotonic()
    assert result.finished is not None
    assert result.finished.outcome is StopReason.FAULTED
    assert ended - forged[0] < 30  # the bounds it would otherwise wait out are 60 s
    fault = str(result.finished.fault)
    if to == "orchestrator":
        assert "could not be read" in fault and "malformed message" in fault, fault
    log = (tmp_path / "stage-1.log").read_text()
    if to == "stage":
        assert "cannot read the orchestrator's frame" in log, log
        # a protocol fault of the run, named by the stage: not a lost stage to re-place
        assert result.finished.fault is not None
        assert result.finished.fault.kind is FaultKind.PROTOCOL_VIOLATION, fault
        assert result.finished.fault_stage == 1
        assert "the orchestrator's frame could not be read" in fault, fault
        assert "malformed message" in fault, fault
    assert len(result.tokens) < 200
    for tap in host.taps.values():
        tap.join(10)
    assert run_resources(result.chain_id) == []


SECRET = new_secret()


@pytest.mark.parametrize(
    "stdin", [b"", b"\n", b"zz\n", b"ab" * 31 + b"\n", SECRET.hex().encode()[:-2]]
)
def test_a_stage_without_its_secret_on_stdin_says_so_in_one_line(stdin: bytes) -> None:
    """Started by hand (or by a launcher that failed to write the secret), a stage exits
    with status 2 and one line saying what it read, not a traceback."""
    a, b = socket.socketpair()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "runtime_cupy.process.stage_process", "--run-label", "r",
             "--stage-index", "0", "--node-id", "n0", "--orchestrator-id", "orch",
             "--control-fd", str(a.fileno()), "--lifeline-fd", str(a.fileno())],
            input=stdin,
            capture_output=True,
            pass_fds=(a.fileno(),),
            env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"},
            timeout=60,
            check=False,
        )  # fmt: skip
    finally:
        a.close()
        b.close()
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "secret on standard input" in lines[0], lines
    assert ("an empty line" in lines[0]) == (stdin.strip() == b"")
    assert SECRET.hex()[:20] not in err  # never echoes what may be most of a secret


def test_the_secret_parses_only_whole() -> None:
    assert parse_secret(SECRET.hex() + "\n") == SECRET
    for bad in ("", "\n", SECRET.hex()[:-2], SECRET.hex() + "00", "g" * 64):
        with pytest.raises(BadSecret, match="secret"):
            parse_secret(bad)


def test_a_run_leaves_the_callers_signals_alone_and_ctrl_c_reaches_it_after_teardown(
    tiny: str,
) -> None:
    """By default a run in the main thread takes over no signal: the program's own
    SIGTERM handler runs (a service's shutdown), and Ctrl-C's ``KeyboardInterrupt``
    reaches the caller once every stage is reaped and every link freed (the run once
    swallowed both, ending ``cancelled``, and the program went on)."""
    prompt = [4, 5, 6]
    heard: list[str] = []
    pids: list[int] = []

    def note(token: int) -> None:
        if not heard:
            os.kill(os.getpid(), signal.SIGTERM)  # the program's handler: heard
        elif heard == ["SIGTERM"]:
            heard.append("Ctrl-C")
            os.kill(os.getpid(), signal.SIGINT)

    def spawned(kind: str, fields: dict[str, object]) -> None:
        if kind == "spawned":
            pids.append(int(str(fields["pid"])))

    previous = signal.signal(signal.SIGTERM, lambda *_: heard.append("SIGTERM"))
    try:
        run = ProcessRun(_plan(tiny, prompt), prompt, on_token=note, on_event=spawned)
        with pytest.raises(KeyboardInterrupt):
            run.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert heard == ["SIGTERM", "Ctrl-C"]
    assert len(pids) == 2 and wait_gone(pids, 0) == []  # reaped before it was raised
    assert run_resources(run.chain_id) == []


@pytest.mark.parametrize("ignored", [False, True], ids=["default", "SIGINT ignored"])
def test_a_run_takes_the_signals_this_process_does_not_ignore(tiny: str, ignored: bool) -> None:
    """With ``handle_signals`` (the command line's), SIGINT and SIGTERM cancel the run
    during it (the launcher's handler); a SIGINT this process ignores (a script's
    background job) stays ignored; both given back after."""
    prompt = [4, 5, 6]
    seen: list[tuple[object, object]] = []

    def note(_token: int) -> None:
        if not seen:
            seen.append((signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)))

    before = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignored else None
    try:
        outside = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        run = ProcessRun(_plan(tiny, prompt), prompt, on_token=note, handle_signals=True)
        result = run.run()
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == outside
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)
    assert result.finished is not None and result.finished.outcome is StopReason.COMPLETED
    ((sigint, sigterm),) = seen
    assert sigterm is not outside[1] and callable(sigterm)  # the launcher's
    if ignored:
        assert sigint == signal.SIG_IGN
    else:
        assert sigint is sigterm  # the same handler: either signal cancels the run
