"""Shared-memory rings between processes (EDGES_AND_WORKERS.md §2-§3): names from
``(run_id, edge_id)``, records across processes in order with backpressure, bounded
waits, close, header validation on load, and clean-up of a killed owner's ring."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from runplan import RingSpec
from runplan.dtypes import DTypeFamily
from runplan.plan import Layout, ObjectKind, ObjectSpec
from runplan.record_header import HeaderCheck, HeaderDType
from runtime_core.edge_ends import EdgeFaultError, ReceiveEnd, SendEnd
from runtime_core.ring import EdgeClosed, EdgeTimeout
from runtime_cupy.edges.shm import (
    MAX_SEGMENT_NAME,
    PREFIX,
    ShmRing,
    remove_run,
    segment_name,
    signal_paths,
)
from runtime_cupy.process.names import edge_dir
from tests.runtime_cupy.test_kill_orchestrator import ROOT
from tests.support.hygiene import SHM, run_resources
from tests.support.waits import blocked_in_poll

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

SPEC = ObjectSpec(ObjectKind.TOKEN, Layout.TOKEN_IDS, DTypeFamily.UINT, 4, 64)
RING = RingSpec(slot_count=2, alignment=64, slot_bytes=256)
EDGE = 3


def _run_id() -> str:
    return f"test-{uuid.uuid4().hex}"


def test_names_derive_from_the_run_and_edge_and_stay_short() -> None:
    run_id = "x" * 64  # the longest run id the object header holds
    name = segment_name(run_id, 2**32)
    assert name.startswith(PREFIX) and len(name) + 1 <= MAX_SEGMENT_NAME
    assert segment_name(run_id, 7) == segment_name(run_id, 7)  # anyone can find it
    assert segment_name(run_id, 7) != segment_name(run_id + "y", 7)
    assert segment_name(run_id, 7) != segment_name(run_id, 8)
    data, space = signal_paths(run_id, 7)
    assert data.parent == space.parent == edge_dir(run_id, 7)
    # A tag per resource: the folder, which a stranger sees made in /tmp, does not name
    # the segment its consumer makes next.
    assert edge_dir(run_id, 7).name != segment_name(run_id, 7)


def _producer(run_id: str, script: str) -> subprocess.Popen[str]:
    """A Python process that attaches to edge ``EDGE`` of ``run_id`` as its producer."""
    code = textwrap.dedent(f"""
        import sys, time
        from runplan import RingSpec
        from runplan.dtypes import DTypeFamily
        from runplan.record_header import HeaderDType
        from runplan.plan import Layout, ObjectKind, ObjectSpec
        from runtime_core.edge_ends import SendEnd
        from runtime_core.ring import EdgeClosed
        from runtime_cupy.edges.shm import ShmRing
        spec = ObjectSpec(ObjectKind.TOKEN, Layout.TOKEN_IDS, DTypeFamily.UINT, 4, 64)
        ring = None
        while ring is None:
            ring = ShmRing.attach({run_id!r}, {EDGE}, RingSpec(2, 64, 256))
            time.sleep(0.001)
        end = SendEnd(ring, {run_id!r}, {EDGE}, spec)
    """) + textwrap.dedent(script)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip


def test_records_cross_processes_in_order_with_backpressure() -> None:
    run_id = _run_id()
    ring = ShmRing.create(run_id, EDGE, RING)
    receiver = ReceiveEnd(ring, HeaderCheck.for_edge(run_id, EDGE, SPEC, 8))
    try:
        # 20 records through 2 slots: the producer blocks on a full ring, and each
        # release below wakes it through the space FIFO.
        producer = _producer(
            run_id,
            """
            for n in range(20):
                end.send(n, 1, HeaderDType.U32, n.to_bytes(4, "little"), timeout_s=10)
            print("sent")
            """,
        )
        got = []
        for n in range(20):
            record = receiver.receive(timeout_s=10)
            assert record.header.sequence == n and record.header.run_id == run_id
            if n == 0:  # the producer fills the other slot, then must wait for a release
                deadline = time.monotonic() + 10
                while ring.published < RING.slot_count and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert blocked_in_poll(producer.pid, 10)  # it waits for a free slot now
                assert ring.published == RING.slot_count  # never more: no overwrite
            got.append(int.from_bytes(record.payload, "little"))
            receiver.release(record)
        assert got == list(range(20))
        out, err = producer.communicate(timeout=20)
        assert producer.returncode == 0 and out.strip() == "sent", err
    finally:
        ring.detach()
        remove_run(run_id, [EDGE])
    assert run_resources(run_id) == []


def test_close_wakes_a_waiting_producer_in_another_process() -> None:
    run_id = _run_id()
    ring = ShmRing.create(run_id, EDGE, RING)
    try:
        producer = _producer(
            run_id,
            """
            for n in range(2):
                end.send(n, 1, HeaderDType.U32, bytes(4), timeout_s=10)
            print("full", flush=True)
            try:
                end.send(2, 1, HeaderDType.U32, bytes(4), timeout_s=30)
            except EdgeClosed:
                print("closed")
            """,
        )
        assert producer.stdout is not None
        assert producer.stdout.readline().strip() == "full"
        assert blocked_in_poll(producer.pid, 10)  # it waits for space now
        began = time.monotonic()
        ring.close()
        out, _ = producer.communicate(timeout=20)
        assert out.strip() == "closed"
        assert time.monotonic() - began < 10  # woken by the close, not the 30 s bound
    finally:
        ring.detach()
        remove_run(run_id, [EDGE])


def test_a_wait_is_bounded_and_a_closed_edge_refuses_both_ends() -> None:
    run_id = _run_id()
    ring = ShmRing.create(run_id, EDGE, RING)
    try:
        receiver = ReceiveEnd(ring, HeaderCheck.for_edge(run_id, EDGE, SPEC, 8))
        with pytest.raises(EdgeTimeout):
            receiver.receive(timeout_s=0.05)
        producer = ShmRing.attach(run_id, EDGE, RING)
        assert producer is not None
        sender = SendEnd(producer, run_id, EDGE, SPEC)
        sender.close()
        with pytest.raises(EdgeClosed):
            receiver.receive(timeout_s=1)
        with pytest.raises(EdgeClosed):
            sender.send(0, 1, HeaderDType.U32, bytes(4), timeout_s=1)
        producer.detach()
    finally:
        ring.detach()
        remove_run(run_id, [EDGE])


def test_a_malformed_record_is_refused_on_load() -> None:
    run_id = _run_id()
    ring = ShmRing.create(run_id, EDGE, RING)
    try:
        receiver = ReceiveEnd(ring, HeaderCheck.for_edge(run_id, EDGE, SPEC, 8))
        producer = ShmRing.attach(run_id, EDGE, RING)
        assert producer is not None
        wrong = ObjectSpec(ObjectKind.ACTIVATION, Layout.ROW_MAJOR, DTypeFamily.FLOAT, 4, 64)
        SendEnd(producer, run_id, EDGE, wrong).send(0, 1, HeaderDType.F32, bytes(8), 1)
        with pytest.raises(EdgeFaultError, match="KIND_MISMATCH"):
            receiver.receive(timeout_s=1)
        assert ring.released == 0  # nothing of it consumed
        producer.detach()
    finally:
        ring.detach()
        remove_run(run_id, [EDGE])


def test_remove_run_frees_the_ring_of_a_killed_owner() -> None:
    run_id = _run_id()
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from runplan import RingSpec
            from runtime_cupy.edges.shm import ShmRing
            ShmRing.create({run_id!r}, {EDGE}, RingSpec(2, 64, 256))
            print("made", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])},
    )  # fmt: skip
    assert owner.stdout is not None
    assert owner.stdout.readline().strip() == "made"
    owner.send_signal(signal.SIGKILL)
    owner.wait(10)
    assert (SHM / segment_name(run_id, EDGE)).exists()  # the dead owner's ring is still there
    assert all(Path(p).exists() for p in signal_paths(run_id, EDGE))
    remove_run(run_id, [EDGE])  # found by name alone
    assert run_resources(run_id) == []
