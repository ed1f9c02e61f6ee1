"""The Ray host's parts that need no cluster: the node pool read from what
``ray.nodes()`` returns (labels a person can read, distinct on one machine; stages
spread with consecutive ones together; memory shared per machine or per GPU), the
stage's control connection (a stranger on the orchestrator's port is refused and the
stage's own connection still comes through), and the rendezvous a stage asks through its
supervisor (what a stage published is withdrawn when it is gone)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any

import pytest

from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges import strangers as strangers_module
from runtime_cupy.edges.handshake_read import HandshakeTimeUp
from runtime_cupy.hosts.ray import control_link
from runtime_cupy.hosts.ray.cluster import (
    ClusterError,
    cpu_stage_nodes,
    gpu_stage_nodes,
    live_hosts,
    spread,
)
from runtime_cupy.hosts.ray.liveness import HeadProbe, RayletWatch
from runtime_cupy.hosts.ray.rendezvous import (
    PublishedAddresses,
    SupervisorRendezvous,
    serve_rendezvous,
)
from runtime_cupy.process.keys import control_key, new_secret
from tests.support.descriptors import no_descriptor_left
from tests.support.trickle import trickle


def _node(node_id: str, address: str, port: int, *, head: bool = False, **res: float) -> Any:
    resources = {"memory": 8e9, **res, f"node:{address}": 1.0}
    if head:
        resources["node:__internal_head__"] = 1.0
    return {"NodeID": node_id, "Alive": True, "NodeManagerAddress": address,
            "NodeManagerPort": port, "Resources": resources}  # fmt: skip


def test_hosts_are_labelled_by_address_and_kept_apart_on_one_machine() -> None:
    nodes = [
        _node("c", "10.0.0.10", 5),
        _node("b", "10.0.0.9", 7),
        _node("a2", "127.0.0.1", 9),
        _node("a1", "127.0.0.1", 3, head=True),
        {**_node("dead", "10.0.0.11", 1), "Alive": False},
    ]
    hosts = live_hosts(nodes)
    # Numeric address order (10.0.0.9 before 10.0.0.10); the head first on its machine.
    assert [h.label for h in hosts] == ["10.0.0.9", "10.0.0.10", "127.0.0.1#0", "127.0.0.1#1"]
    assert [h.ray_node_id for h in hosts] == ["b", "c", "a1", "a2"]
    assert hosts[2].is_head and not hosts[3].is_head


def test_a_nodes_label_outlives_a_dead_neighbour_on_its_machine() -> None:
    """Three nodes of one machine; the middle one dies: the third keeps its label (it
    took the dead node's, ``#1``, and recovery, whose placement still mapped ``#1`` to
    the dead node, re-placed a stage there)."""
    nodes = [
        _node("a1", "127.0.0.1", 3, head=True),
        _node("a2", "127.0.0.1", 5),
        _node("a3", "127.0.0.1", 9),
    ]
    before = {h.label: h.ray_node_id for h in live_hosts(nodes)}
    assert before == {"127.0.0.1#0": "a1", "127.0.0.1#1": "a2", "127.0.0.1#2": "a3"}
    nodes[1] = {**nodes[1], "Alive": False}
    after = {h.label: h.ray_node_id for h in live_hosts(nodes)}
    assert after == {"127.0.0.1#0": "a1", "127.0.0.1#2": "a3"}


def test_stages_spread_over_hosts_with_consecutive_stages_together() -> None:
    assert spread(3, 3) == [0, 1, 2]
    assert spread(4, 3) == [0, 0, 1, 2]
    assert spread(2, 3) == [0, 1]
    hosts = live_hosts([_node("a", "10.0.0.1", 1), _node("b", "10.0.0.2", 1)])
    nodes = cpu_stage_nodes(hosts, 5)
    assert [n.node_id for n in nodes] == [
        "10.0.0.1/cpu0", "10.0.0.1/cpu1", "10.0.0.1/cpu2", "10.0.0.2/cpu0", "10.0.0.2/cpu1"
    ]  # fmt: skip
    # A machine's stages share its memory, as the planner's devices do.
    assert {n.spec.device for n in nodes} == {"10.0.0.1", "10.0.0.2"}
    assert all(n.spec.memory_bytes == 8_000_000_000 and n.device is None for n in nodes)


def test_gpu_stages_go_to_gpus_and_need_their_memory() -> None:
    hosts = live_hosts([_node("a", "10.0.0.1", 1, GPU=2), _node("b", "10.0.0.2", 1, GPU=1)])
    memory = {"a": {0: 80 << 30, 1: 80 << 30}, "b": {0: 24 << 30}}
    nodes = gpu_stage_nodes(hosts, 4, memory)
    # Four stages on three GPUs: the first GPU holds two (consecutive), sharing it.
    assert [n.node_id for n in nodes] == [
        "10.0.0.1/gpu0", "10.0.0.1/gpu0.1", "10.0.0.1/gpu1", "10.0.0.2/gpu0"
    ]  # fmt: skip
    assert [n.device for n in nodes] == [0, 0, 1, 0]
    assert nodes[0].spec.device == nodes[1].spec.device == "10.0.0.1/gpu0"
    assert [n.spec.memory_bytes for n in nodes] == [80 << 30] * 3 + [24 << 30]
    with pytest.raises(ClusterError, match="nvidia-smi there does not list GPU 1"):
        gpu_stage_nodes(hosts, 2, {"a": {0: 1}})
    with pytest.raises(ClusterError, match="no live node of the cluster has one"):
        gpu_stage_nodes(live_hosts([_node("a", "10.0.0.1", 1)]), 1, {})
    with pytest.raises(ClusterError, match="no live node"):
        cpu_stage_nodes((), 1)


def test_strangers_on_the_control_port_are_refused_and_the_stage_gets_through() -> None:
    secret = new_secret()
    key = control_key(secret, "10.0.0.2/cpu0")
    listener = control_link.ControlListener("127.0.0.1")
    host, port = listener.address.rsplit(":", 1)
    outcomes: list[str] = []

    def strangers_then_the_stage() -> None:
        with socket.create_connection((host, int(port))) as s:  # garbage
            s.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 100)
        for who, k, index in (("wrong key", new_secret(), 1), ("other stage", key, 2)):
            try:
                control_link.connect(listener.address, index, control_key(k, "x") if
                                     who == "wrong key" else k, 5)  # fmt: skip
                outcomes.append(f"{who}: accepted")
            except (OSError, hs.HandshakeRefused) as exc:
                outcomes.append(f"{who}: refused ({type(exc).__name__})")
        sock = control_link.connect(listener.address, 1, key, 5)
        outcomes.append("stage: connected")
        sock.close()

    thread = threading.Thread(target=strangers_then_the_stage)
    thread.start()
    try:
        conn = listener.accept(1, key, 30, lambda: None)
        conn.close()
    finally:
        thread.join(30)
        listener.close()
    assert outcomes[-1] == "stage: connected"
    assert all("refused" in o for o in outcomes[:-1]), outcomes


def test_strangers_that_connect_and_hold_the_control_port_hold_no_stage_up() -> None:
    """One stranger says nothing, another trickles the start of a HELLO: the stage's
    handshake goes on beside theirs and gets through at once (it waited behind the
    first, ran out after ``HANDSHAKE_S`` and the stage could not start)."""
    key = control_key(new_secret(), "10.0.0.2/cpu0")
    listener = control_link.ControlListener("127.0.0.1")
    host, port = listener.address.rsplit(":", 1)
    silent = socket.create_connection((host, int(port)))
    slow = socket.create_connection((host, int(port)))
    slow.sendall(hs.hello(key, 1, control_link.CONTROL, hs.new_nonce())[:6])
    outcomes: list[str] = []

    def the_stage() -> None:
        try:
            control_link.connect(listener.address, 1, key, 5).close()
            outcomes.append("stage: connected")
        except OSError as exc:
            outcomes.append(f"stage: {type(exc).__name__}: {exc}")

    thread = threading.Thread(target=the_stage)
    thread.start()
    try:  # the stage gives up after HANDSHAKE_S without a reply: the two strangers' 20 s
        listener.accept(1, key, 30, lambda: None).close()
    finally:
        thread.join(30)
        silent.close()
        slow.close()
        listener.close()
    assert outcomes == ["stage: connected"]


def _accept_in_a_thread(
    listener: control_link.ControlListener, key: bytes
) -> tuple[threading.Thread, list[object]]:
    got: list[object] = []

    def accept() -> None:
        try:
            got.append(listener.accept(1, key, 30, lambda: None))
        except Exception as exc:
            got.append(exc)

    thread = threading.Thread(target=accept)
    thread.start()
    return thread, got


def test_past_max_strangers_the_oldest_knock_goes_and_the_refusals_are_summed_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Idle connections each hold a descriptor for ``HANDSHAKE_S``: past
    ``MAX_STRANGERS`` the oldest is refused (there was no bound), and past the first
    refusals the rest are summed up in one warning (one warning each)."""
    monkeypatch.setattr(control_link, "MAX_STRANGERS", 4)
    monkeypatch.setattr(strangers_module, "LOGGED_REFUSALS", 2)
    caplog.set_level(logging.WARNING, logger="runtime_cupy.hosts.ray")
    key = control_key(new_secret(), "10.0.0.2/cpu0")
    listener = control_link.ControlListener("127.0.0.1")
    host, port = listener.address.rsplit(":", 1)
    thread, got = _accept_in_a_thread(listener, key)
    idle = [socket.create_connection((host, int(port))) for _ in range(10)]
    try:
        for sock in idle[:6]:
            sock.settimeout(5)
            assert sock.recv(1) == b""
        control_link.connect(listener.address, 1, key, 5).close()
        thread.join(30)
        assert isinstance(got[0], socket.socket), got
        got[0].close()
    finally:
        for sock in idle:
            sock.close()
        listener.close()
    said = [r.getMessage() for r in caplog.records]
    assert sum("refused a connection from" in m for m in said) == 2, said
    summary = [m for m in said if "more connections" in m]
    # six pushed out by the strangers after them, a seventh by the stage's connection
    assert len(summary) == 1, said
    assert summary[0].endswith("refused 5 more connections (7 in all): 5 pushed out by newer "
                               "connections before it proved the key"), said  # fmt: skip


def _proven_knock(address: str, key: bytes) -> tuple[socket.socket, bytes, bytes]:
    """A stage's connection whose HELLO proved its key: the socket, its nonces."""
    host, port = control_link._split(address)
    sock = socket.create_connection((host, port), timeout=5)
    nonce_p = hs.new_nonce()
    sock.sendall(hs.hello(key, 1, control_link.CONTROL, nonce_p))
    head = sock.recv(hs.REPLY_HEAD_BYTES, socket.MSG_WAITALL)
    reply = head + sock.recv(hs.reply_bytes(head) - len(head), socket.MSG_WAITALL)
    return sock, nonce_p, hs.read_reply(key, 1, control_link.CONTROL, nonce_p, reply)


def test_a_knock_that_proved_its_key_is_not_pushed_out_by_strangers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Strangers past ``MAX_STRANGERS`` that come after the stage's HELLO push out the
    oldest strangers, not the stage's connection (it was the oldest knock, refused;
    ``accept`` then waited on for a stage already let in); past ``MAX_PROVEN`` proven
    knocks (a HELLO replayed) the oldest proven one goes."""
    monkeypatch.setattr(control_link, "MAX_STRANGERS", 4)
    monkeypatch.setattr(control_link, "MAX_PROVEN", 1)
    key = control_key(new_secret(), "10.0.0.2/cpu0")
    listener = control_link.ControlListener("127.0.0.1")
    host, port = listener.address.rsplit(":", 1)
    thread, got = _accept_in_a_thread(listener, key)
    replayed, _nonce_p, _nonce_c = _proven_knock(listener.address, key)
    stage, nonce_p, nonce_c = _proven_knock(listener.address, key)
    idle = [socket.create_connection((host, int(port))) for _ in range(6)]
    try:
        replayed.settimeout(5)
        assert replayed.recv(1) == b""  # the oldest proven one, past MAX_PROVEN
        for sock in idle[:2]:
            sock.settimeout(5)
            assert sock.recv(1) == b""
        stage.sendall(hs.confirm(key, 1, control_link.CONTROL, nonce_c, nonce_p))
        thread.join(30)
        assert isinstance(got[0], socket.socket), got
        got[0].close()
    finally:
        for sock in [replayed, stage, *idle]:
            sock.close()
        listener.close()


class _Gate:
    """``gone`` for ``ControlListener.accept`` that holds the listener before its next
    poll while the gate is shut, so that what the test sends meanwhile is all there at
    that poll."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._waiting = threading.Event()

    def __call__(self) -> None:
        self._waiting.set()
        self._open.wait(30)

    def shut(self) -> None:
        """Shut it and wait until the listener waits at it."""
        self._open.clear()
        self._waiting.clear()
        assert self._waiting.wait(5)

    def open(self) -> None:
        time.sleep(0.1)  # what was sent is in the listener's socket buffers
        self._open.set()


class _GatedAccept:
    """A control port accepting stage 1 (proving ``key``) on a thread of its own, once
    ``thread`` is started, held before each poll while its ``gate`` is shut."""

    def __init__(self) -> None:
        self.key = control_key(new_secret(), "10.0.0.2/cpu0")
        self.listener = control_link.ControlListener("127.0.0.1")
        self.host, self.port = control_link._split(self.listener.address)
        self.gate = _Gate()
        self.got: list[object] = []
        self.thread = threading.Thread(target=self._accept)

    def _accept(self) -> None:
        try:
            self.got.append(self.listener.accept(1, self.key, 30, self.gate))
        except Exception as exc:
            self.got.append(exc)

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=5)

    def let_in(self) -> None:
        """The accept ended with a socket (the stage let in), closed here."""
        self.thread.join(30)
        assert isinstance(self.got[0], socket.socket), self.got
        self.got[0].close()

    def close(self, *socks: socket.socket) -> None:
        self.gate.open()
        if self.thread.ident is not None:  # started
            self.thread.join(30)
        for sock in socks:
            sock.close()
        self.listener.close()


def _hello_answer(sock: socket.socket, key: bytes, nonce_p: bytes) -> bytes:
    head = sock.recv(hs.REPLY_HEAD_BYTES, socket.MSG_WAITALL)
    reply = head + sock.recv(hs.reply_bytes(head) - len(head), socket.MSG_WAITALL)
    return hs.read_reply(key, 1, control_link.CONTROL, nonce_p, reply)


def test_a_stage_whose_hello_came_with_a_flood_is_looked_at_before_it_is_pushed_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stage connected, then its HELLO and a stranger came at once: the stranger,
    accepted first, made the knocks without a proven HELLO more than ``MAX_STRANGERS``,
    and the oldest of them, the stage's, was refused with its HELLO unread. A last look
    at what it sent proves it, and the stranger goes instead."""
    monkeypatch.setattr(control_link, "MAX_STRANGERS", 1)
    port = _GatedAccept()
    key, gate = port.key, port.gate
    stage = port.connect()
    port.thread.start()
    strangers: list[socket.socket] = []
    try:
        gate.shut()  # the stage's connection accepted, a stranger so far
        nonce_p = hs.new_nonce()
        stage.sendall(hs.hello(key, 1, control_link.CONTROL, nonce_p))
        strangers.append(port.connect())
        gate.open()
        nonce_c = _hello_answer(stage, key, nonce_p)
        stage.sendall(hs.confirm(key, 1, control_link.CONTROL, nonce_c, nonce_p))
        port.let_in()
    finally:
        port.close(stage, *strangers)


def test_a_proven_stage_whose_confirm_came_with_a_replayed_hello_is_let_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stage's CONFIRM, a copy of its HELLO and a stranger came at once: the
    stranger, accepted first, made the knocks without a proven HELLO too many; the last
    look at the oldest, the copy, proves it, which makes the proven knocks more than
    ``MAX_PROVEN``: the oldest of them, the stage's, is looked at too before it is
    pushed out, and is let in with the CONFIRM it sent."""
    monkeypatch.setattr(control_link, "MAX_STRANGERS", 1)
    monkeypatch.setattr(control_link, "MAX_PROVEN", 1)
    port = _GatedAccept()
    key, gate = port.key, port.gate
    stage = port.connect()
    hello = hs.hello(key, 1, control_link.CONTROL, nonce_p := hs.new_nonce())
    stage.sendall(hello)  # proven when the copy's connection comes (a last look)
    copy = port.connect()
    port.thread.start()
    strangers: list[socket.socket] = []
    try:
        nonce_c = _hello_answer(stage, key, nonce_p)
        gate.shut()
        stage.sendall(hs.confirm(key, 1, control_link.CONTROL, nonce_c, nonce_p))
        copy.sendall(hello)
        strangers.append(port.connect())
        gate.open()
        port.let_in()
    finally:
        port.close(stage, copy, *strangers)


def test_an_accept_without_a_descriptor_rests_the_control_port_and_the_stage_gets_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Strangers wait in the backlog while this process has no descriptor left: each
    accept fails, the port rests ``ACCEPT_PAUSE_S`` after each, with one warning, and
    the stage that connects once descriptors are back gets in (the ``EMFILE`` escaped:
    the stage "could not be started: Too many open files")."""
    caplog.set_level(logging.DEBUG, logger="runtime_cupy.hosts.ray")
    key = control_key(new_secret(), "10.0.0.2/cpu0")
    listener = control_link.ControlListener("127.0.0.1")
    host, port = listener.address.rsplit(":", 1)
    waiting = [socket.socket() for _ in range(3)]  # their descriptors taken beforehand
    serving_s = 0.5
    thread, got = _accept_in_a_thread(listener, key)
    try:
        with no_descriptor_left():
            for sock in waiting:
                sock.connect((host, int(port)))
            time.sleep(serving_s)
        control_link.connect(listener.address, 1, key, 5).close()
        thread.join(30)
        assert isinstance(got[0], socket.socket), got
        got[0].close()
    finally:
        for sock in waiting:
            sock.close()
        listener.close()
    failed = [r for r in caplog.records if "accept failed" in r.getMessage()]
    assert 1 <= len(failed) <= serving_s / strangers_module.ACCEPT_PAUSE_S + 3, len(failed)
    assert [r.levelno for r in failed].count(logging.WARNING) == 1


def test_a_supervisor_whose_orchestrator_trickles_its_challenge_gives_up_at_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The supervisor's ``HANDSHAKE_S`` bounded each read, not the handshake: whoever
    answers in the orchestrator's place (a man in the middle) sending its CHALLENGE a
    byte at a time, each before a read's bound ran out, held the stage's start for 72
    times the bound. The whole handshake now ends at the bound, naming it."""
    monkeypatch.setattr(control_link, "HANDSHAKE_S", 0.5)
    key = control_key(new_secret(), "10.0.0.2/cpu0")
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve_slowly() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(hs.HELLO_BYTES, socket.MSG_WAITALL)
                challenge = hs.challenge(key, 1, control_link.CONTROL, bytes(32), bytes(32))
                trickle(conn, challenge, 0.2, stop)

        thread = threading.Thread(target=serve_slowly)
        thread.start()
        try:
            with pytest.raises(HandshakeTimeUp, match=r"more than 0.5 s over its handshake"):
                control_link.connect(f"127.0.0.1:{port}", 1, key, 5)
        finally:
            stop.set()
            thread.join(30)


def test_no_control_connection_ends_when_the_supervisor_says_why() -> None:
    listener = control_link.ControlListener("127.0.0.1")
    try:
        with pytest.raises(control_link.ControlLinkError, match="node is gone"):
            listener.accept(0, control_key(new_secret(), "n"), 30, lambda: "node is gone")
    finally:
        listener.close()


class DictStore:
    def __init__(self) -> None:
        self.data: dict[tuple[str, int], str] = {}

    def publish(self, run_id: str, edge_id: int, address: str) -> None:
        self.data[(run_id, edge_id)] = address

    def lookup(self, run_id: str, edge_id: int) -> str | None:
        return self.data.get((run_id, edge_id))

    def withdraw(self, run_id: str, edge_id: int) -> None:
        self.data.pop((run_id, edge_id), None)


def test_a_stage_asks_its_supervisor_and_what_it_published_goes_with_it() -> None:
    store = DictStore()
    published = PublishedAddresses(store)  # type: ignore[arg-type]
    stage_end, supervisor_end = socket.socketpair()
    server = threading.Thread(target=serve_rendezvous, args=(supervisor_end, published))
    server.start()
    rendezvous = SupervisorRendezvous(stage_end)
    assert rendezvous.lookup("run", 2) is None
    rendezvous.publish("run", 2, "10.0.0.2:4000")
    rendezvous.publish("run", 3, "10.0.0.2:4001")
    assert store.data == {("run", 2): "10.0.0.2:4000", ("run", 3): "10.0.0.2:4001"}
    rendezvous.withdraw("run", 2)
    assert store.data == {("run", 3): "10.0.0.2:4001"}
    rendezvous.close()  # the stage is gone
    server.join(10)
    published.withdraw_all()
    assert store.data == {}


def test_a_cluster_that_is_not_there_is_one_line_and_exit_2() -> None:
    import subprocess
    import sys

    from tests.runtime_cupy.test_process_cli import _env

    proc = subprocess.run(
        [sys.executable, "-m", "runtime_cupy", "--ray-address", "127.0.0.1:1", "--stages", "2",
         "--prompt-ids", "1,2", "--max-tokens", "2"],
        capture_output=True, text=True, check=False, env=_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no Ray cluster at 127.0.0.1:1" in lines[0], proc.stderr


def test_the_live_nodes_after_a_loss_are_the_live_hosts_nodes_and_a_spare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``RayHost.live_nodes`` (a chain re-placed after a loss, issue 25): the chain's nodes
    on hosts still live (a second stage on a host too), then one node per other live
    host; a lost host's nodes are not there."""
    from runtime_cupy.hosts.ray import session
    from runtime_cupy.hosts.ray.host import RayHost

    three = live_hosts([_node(n, f"10.0.0.{i}", 1) for i, n in enumerate("abc", 1)])
    placed = cpu_stage_nodes(three[:2], 3)  # 10.0.0.1/cpu0, 10.0.0.1/cpu1, 10.0.0.2/cpu0
    host = RayHost(placed, "10.0.0.9")
    known = [(n.spec, n.device) for n in placed]
    alive = [h for h in three if h.address != "10.0.0.2"]  # host 2 lost
    monkeypatch.setattr(session, "hosts", lambda: tuple(alive))
    monkeypatch.setattr(session, "stage_nodes", lambda _w, n: cpu_stage_nodes(alive, n))
    live = [spec.node_id for spec, _ in host.live_nodes(known, "cpu")]
    assert live == ["10.0.0.1/cpu0", "10.0.0.1/cpu1", "10.0.0.3/cpu0"]
    assert host.machine("10.0.0.3/cpu0") == "10.0.0.3"  # a node it can start a stage on


def test_a_label_that_came_to_name_a_live_node_is_not_offered_as_the_dead_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Labels of one machine's nodes follow their raylets' ports: a node that joins with a
    lower port moves the labels above it. A label the host saw naming a node now dead,
    which names a live node after such a move, is offered as that live node (it was
    offered as the dead one: a stage re-placed there could not be scheduled); a label
    whose first node lives on elsewhere is not offered twice."""
    from runtime_cupy.hosts.ray import session
    from runtime_cupy.hosts.ray.host import RayHost

    a1, a2, x = (
        _node("a1", "127.0.0.1", 3, head=True),
        _node("a2", "127.0.0.1", 5),
        _node("x", "127.0.0.1", 9),
    )
    first = cpu_stage_nodes(live_hosts([a1, a2, x]), 3)  # #0 a1, #1 a2, #2 x
    host = RayHost(first, "10.0.0.9")
    known = [(n.spec, n.device) for n in first[:2]]  # stages on #0 and #1; #2 seen, unused
    # x dies; y joins below a2's port: #0 a1, #1 y, #2 a2, #3 x (dead)
    y = _node("y", "127.0.0.1", 4)
    now = live_hosts([a1, a2, {**x, "Alive": False}, y])
    monkeypatch.setattr(session, "hosts", lambda: now)
    monkeypatch.setattr(session, "stage_nodes", lambda _w, n: cpu_stage_nodes(now, n))
    offered = {spec.node_id: host._node(spec.node_id).host.ray_node_id
               for spec, _ in host.live_nodes(known, "cpu")}  # fmt: skip
    assert offered == {"127.0.0.1#0/cpu0": "a1", "127.0.0.1#1/cpu0": "a2"}, offered
    # (#2 names a2 now, already offered as #1: not twice, nor as x; y's label is #1's.)


def test_a_raylet_started_again_on_its_port_takes_a_new_label() -> None:
    """The dead node and its successor on one port: the dead one keeps its place, so the
    live nodes' labels do not move (they were ordered by node id, at random)."""
    nodes = [_node("a1", "127.0.0.1", 3, head=True), _node("x", "127.0.0.1", 9)]
    for dead_id, new_id in (("x", "zz"), ("x", "00")):  # the new id after or before
        now = [nodes[0], {**nodes[1], "NodeID": dead_id, "Alive": False},
               _node(new_id, "127.0.0.1", 9)]  # fmt: skip
        labels = {h.label: h.ray_node_id for h in live_hosts(now)}
        assert labels == {"127.0.0.1#0": "a1", "127.0.0.1#2": new_id}, labels


def test_another_gpu_of_a_stages_machine_is_a_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the CUDA worker each GPU is a node: a Ray node offered once means once per
    GPU, so the second GPU of the machine whose first GPU holds a stage stays a spare."""
    from runtime_cupy.hosts.ray import session
    from runtime_cupy.hosts.ray.host import RayHost

    hosts = live_hosts([_node("a", "10.0.0.1", 1, GPU=2), _node("b", "10.0.0.2", 1, GPU=1)])
    memory = {"a": {0: 8 << 30, 1: 8 << 30}, "b": {0: 8 << 30}}
    placed = gpu_stage_nodes(hosts, 2, memory)  # a's gpu0, then a's gpu1 or b's gpu0
    host = RayHost(placed[:1], "10.0.0.9")
    known = [(placed[0].spec, placed[0].device)]
    monkeypatch.setattr(session, "hosts", lambda: hosts)
    monkeypatch.setattr(session, "gpu_memory", lambda _h, _s: session.GpuMemory(memory, {}))
    live = [(spec.node_id, device) for spec, device in host.live_nodes(known, "cuda")]
    assert live[0] == (placed[0].spec.node_id, 0)
    assert ("10.0.0.1/gpu1", 1) in live and ("10.0.0.2/gpu0", 0) in live, live


def test_a_gpu_host_that_does_not_report_its_memory_is_placed_around(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A re-placement asks each GPU host its GPUs' memory within the chain's silence
    bound (``RayHost.silence_s``): a host that did not answer (paused: its raylet's port
    still takes connections) is placed around as a lost host is, its stages' nodes and
    its GPUs left out; the recovery waited 120 s for it, then failed with Ray's untyped
    ``GetTimeoutError``."""
    from runtime_cupy.hosts.ray import session
    from runtime_cupy.hosts.ray.host import RayHost

    hosts = live_hosts([_node("a", "10.0.0.1", 1, GPU=1), _node("b", "10.0.0.2", 1, GPU=2)])
    memory = {"a": {0: 8 << 30}, "b": {0: 8 << 30, 1: 8 << 30}}
    placed = gpu_stage_nodes(hosts, 2, memory)  # a's gpu0, b's gpu0
    host = RayHost(placed, "10.0.0.9", silence_s=0.5)
    known = [(n.spec, n.device) for n in placed]
    asked: list[float] = []

    def b_paused(of: tuple[Any, ...], within_s: float) -> Any:
        asked.append(within_s)
        return session.GpuMemory({"a": memory["a"]}, {"b": "host 10.0.0.2 did not report"})

    monkeypatch.setattr(session, "hosts", lambda: hosts)
    monkeypatch.setattr(session, "gpu_memory", b_paused)
    live = [(spec.node_id, device) for spec, device in host.live_nodes(known, "cuda")]
    assert live == [("10.0.0.1/gpu0", 0)] and asked == [0.5], (live, asked)


def test_a_chain_whose_gpu_hosts_are_all_silent_ends_with_a_typed_error_naming_them(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No GPU host answered the memory query within the bound: nothing is left to place
    the chain on, and the re-placement is ``Unplaced`` (a ``ChainError``; the stream
    ends with it), naming the lost stages' nodes on those hosts, at once."""
    from runtime_cupy.hosts.ray import session
    from runtime_cupy.hosts.ray.host import RayHost
    from runtime_cupy.serve.chain import Unplaced, WarmChain
    from runtime_cupy.serve.recovery import Recoveries, Replacer

    hosts = live_hosts([_node("a", "10.0.0.1", 1, GPU=1), _node("b", "10.0.0.2", 1, GPU=1)])
    placed = gpu_stage_nodes(hosts, 2, {"a": {0: 1 << 40}, "b": {0: 1 << 40}})
    ray_host = RayHost(placed, "10.0.0.9", silence_s=0.5)
    silent = {h.ray_node_id: f"host {h.label} did not report" for h in hosts}
    monkeypatch.setattr(session, "hosts", lambda: hosts)
    monkeypatch.setattr(session, "gpu_memory", lambda _h, _s: session.GpuMemory({}, silent))
    nodes = tuple(n.spec for n in placed)
    chain = WarmChain(tiny, stages=2, context=64, host=ray_host, nodes=nodes, recover=True)
    chain.replacer = Replacer(ray_host, "cuda", nodes, (0, 0), (), Recoveries())
    chain.replacer.lost = (1,)  # as Replacer.lose leaves it after the loss
    with pytest.raises(Unplaced) as info:
        chain._place_again()
    message = str(info.value)
    assert "no live node is left" in message, message
    assert "'10.0.0.1/gpu0', '10.0.0.2/gpu0'" in message, message


def test_a_first_placement_passes_a_silent_gpu_host_over_and_names_it_when_none_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``session.stage_nodes`` for the CUDA worker: a GPU host that did not report its
    memory within the bound is passed over; with none left, one ``ClusterError`` naming
    each silent host (it was Ray's ``GetTimeoutError`` after 120 s)."""
    from runtime_cupy.hosts.ray import session

    hosts = live_hosts([_node("a", "10.0.0.1", 1, GPU=1), _node("b", "10.0.0.2", 1, GPU=1)])
    said = {"b": "host 10.0.0.2 did not report its GPUs' memory within 120 s"}
    monkeypatch.setattr(session, "hosts", lambda: hosts)
    monkeypatch.setattr(
        session, "gpu_memory", lambda _h, _s: session.GpuMemory({"a": {0: 8 << 30}}, said)
    )
    placed = [n.node_id for n in session.stage_nodes("cuda", 2)]
    assert placed == ["10.0.0.1/gpu0", "10.0.0.1/gpu0.1"], placed
    said = {**said, "a": "host 10.0.0.1 could not report its GPUs' memory: gone"}
    monkeypatch.setattr(session, "gpu_memory", lambda _h, _s: session.GpuMemory({}, said))
    with pytest.raises(ClusterError, match="no live node of the cluster that has one") as info:
        session.stage_nodes("cuda", 1)
    assert all(why in str(info.value) for why in said.values()), info.value


def test_a_node_whose_raylet_does_not_answer_is_not_live() -> None:
    """Ray calls a node alive until its health checks fail, 15 s or more after its raylet
    died: a stage re-placed there meanwhile waited its start out (120 s). A node whose
    raylet does not answer is not live; the others keep their labels."""
    nodes = [
        _node("a1", "127.0.0.1", 3, head=True),
        _node("a2", "127.0.0.1", 5),
        _node("a3", "127.0.0.1", 9),
    ]
    hosts = live_hosts(nodes, answers=lambda _address, port: port != 5)
    assert {h.label: h.ray_node_id for h in hosts} == {"127.0.0.1#0": "a1", "127.0.0.1#2": "a3"}
    assert [h.manager_port for h in hosts] == [3, 9]


def _closed_port() -> int:
    """A port of this machine where nothing listens (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _GrpcListener:
    """A listener that answers each connection's HTTP/2 preface with an empty SETTINGS
    frame, as a raylet's gRPC server does."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(64)
                conn.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))

    def close(self) -> None:
        self.sock.close()
        self._thread.join(10)


def test_the_clusters_hosts_are_the_nodes_whose_raylet_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``session.hosts``: of the nodes Ray calls alive, those whose raylet answers now
    (the live pool of a recovery, the nodes of a new run): it accepts a connection and
    answers gRPC's preface. A paused raylet (SIGSTOP: its port still takes connections,
    the kernel accepts them, but nothing answers) is not live: it was, and a recovery
    started a stage again on its host and waited for it until Ray called the node dead."""
    import ray

    from runtime_cupy.hosts.ray import session

    raylet = _GrpcListener()
    try:
        with socket.create_server(("127.0.0.1", 0)) as paused:
            nodes = [
                _node("up", "127.0.0.1", raylet.port, head=True),
                _node("dead", "127.0.0.1", _closed_port()),
                _node("paused", "127.0.0.1", paused.getsockname()[1]),
            ]
            monkeypatch.setattr(ray, "nodes", lambda: nodes)
            assert [h.ray_node_id for h in session.hosts()] == ["up"]
            assert not session.raylet_answers("127.0.0.1", paused.getsockname()[1], 0.2)
    finally:
        raylet.close()


def test_a_stage_start_on_a_node_whose_raylet_is_gone_ends_naming_it() -> None:
    """A stage's start on a node whose raylet died (not yet dead to Ray) ends once its
    raylet does not answer (three asks in a row), naming it: the wait for its control
    connection is not waited out."""
    from runtime_cupy.hosts.ray import session

    port = _closed_port()
    watch = RayletWatch("127.0.0.1", port, session.raylet_answers, ask_s=0.0)
    assert [watch.gone(), watch.gone()] == [None, None]
    why = watch.gone()
    assert why == f"its node is gone: the raylet at 127.0.0.1:{port} does not answer (3 asks)"


class _Clock:
    """A clock that moves only when told (``now``, seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_raylet_that_misses_one_ask_is_not_gone() -> None:
    """One dropped packet or a busy raylet (an ask unanswered, then an answer) is no
    loss: the node is gone only after ``RAYLET_MISSES`` asks in a row, at most one per
    ``ask_s`` (it was gone after one failed 1 s connect)."""
    said = iter([False, True, False, False, False])
    asked: list[float] = []
    clock = _Clock()

    def answers(address: str, port: int) -> bool:
        assert (address, port) == ("10.0.0.7", 41)
        asked.append(clock.now)
        return next(said)

    watch = RayletWatch("10.0.0.7", 41, answers, ask_s=1.0, misses=3, clock=clock)
    assert watch.gone() is None and asked == []  # not asked within ask_s of the start
    found = []
    for _ in range(10):
        clock.now += 0.5
        found.append(watch.gone())
    # asked every second: missed, answered, then three misses in a row
    assert asked == [101.0, 102.0, 103.0, 104.0, 105.0]
    assert found[:9] == [None] * 9
    assert found[9] == "its node is gone: the raylet at 10.0.0.7:41 does not answer (3 asks)"


@pytest.mark.parametrize(
    ("kwargs", "named"), [({"misses": 0}, "misses 0"), ({"ask_s": -1.0}, "ask_s -1.0")]
)
def test_a_raylet_watch_refuses_bounds_that_mean_nothing(
    kwargs: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        RayletWatch("10.0.0.7", 41, lambda _a, _p: True, **kwargs)


def test_a_silent_head_is_taken_as_silent_for_a_while_an_answer_never() -> None:
    asked: list[float] = []
    clock = _Clock()
    said = [False, True, True, False]

    def answers() -> bool:
        asked.append(clock.now)
        return said[len(asked) - 1]

    head = HeadProbe(answers, remember_s=5.0, clock=clock)
    assert not head()
    clock.now += 4.9
    assert not head() and asked == [100.0]  # the silence still
    clock.now += 0.1
    assert head() and asked == [100.0, 105.0]  # asked again: it answers
    assert head() and asked == [100.0, 105.0, 105.0]  # an answer is not kept
    assert not head() and len(asked) == 4  # lost since: seen at once
    with pytest.raises(ValueError, match="remember_s -1"):
        HeadProbe(answers, remember_s=-1)


def test_a_head_lost_after_a_release_is_asked_again_by_the_cleanup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A warm stage released while the head answers, the head lost before the chain's
    cleanup: the cleanup must not call through the lost head (Ray blocks each such
    call until it ends the driver, 60 s later)."""
    import ray

    from runtime_cupy.hosts.ray import session
    from runtime_cupy.hosts.ray.host import RayHost

    asked: list[str] = []
    hosts = live_hosts([_node(f"n{i}", "127.0.0.1", 10 + i) for i in range(2)])
    nodes = cpu_stage_nodes(hosts, 2)
    host = RayHost(nodes, "127.0.0.1")
    alive = [True]
    monkeypatch.setattr(session, "head_answers", lambda: alive[0])
    for name in ("kill", "wait", "get"):
        monkeypatch.setattr(ray, name, lambda *_a, name=name, **_k: asked.append(name))
    first = nodes[0].node_id
    host._actors[first] = object()
    host._warm.add(first)
    host._release(first, host._actors[first])
    assert asked == ["kill"]  # through the head that answered
    asked.clear()
    alive[0] = False
    host._actors[nodes[1].node_id] = _Unreachable(asked)
    host.cleanup("chain-1", [1])
    assert asked == [] and host._actors == {}, asked


def test_a_chains_cleanup_asks_the_head_once_for_every_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A warm chain of three stages closed while the head's packets are dropped: its
    stages released, then its cleanup, ask whether the head answers once (each ask
    waited its 1 s out: it was asked once per stage, and once more)."""
    import ray

    from runtime_cupy.hosts.ray import session
    from runtime_cupy.hosts.ray.host import RayHost

    probes: list[str] = []
    asked: list[str] = []
    hosts = live_hosts([_node(f"n{i}", "127.0.0.1", 10 + i) for i in range(3)])
    nodes = cpu_stage_nodes(hosts, 3)
    host = RayHost(nodes, "127.0.0.1")
    for node in nodes:
        host._actors[node.node_id] = _Unreachable(asked)
        host._warm.add(node.node_id)
    monkeypatch.setattr(session, "head_answers", lambda: probes.append("head") or False)
    for name in ("kill", "wait", "get"):
        monkeypatch.setattr(ray, name, lambda *_a, name=name, **_k: asked.append(name))
    for node in nodes:  # the chain closes each stage's handle
        host._release(node.node_id, host._actors[node.node_id])
    host.cleanup("chain-1", [1, 2])
    assert probes == ["head"]
    assert asked == [] and host._actors == {}


def test_the_head_answers_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """``session.head_answers``: whether the cluster's GCS answers (a connection, and
    gRPC's preface answered); a paused one, whose port still takes connections, does
    not."""
    import ray

    from runtime_cupy.hosts.ray import session

    class Context:
        gcs_address = ""

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context)
    Context.gcs_address = f"127.0.0.1:{_closed_port()}"
    assert not session.head_answers()
    gcs = _GrpcListener()
    try:
        Context.gcs_address = f"127.0.0.1:{gcs.port}"
        assert session.head_answers()
    finally:
        gcs.close()
    with socket.create_server(("127.0.0.1", 0)) as paused:
        Context.gcs_address = f"127.0.0.1:{paused.getsockname()[1]}"
        assert not session.head_answers(0.2)


class _Unreachable:
    """A supervisor whose every call goes through a head that is gone (Ray blocks such a
    call until it ends the process, 60 s later): each call is noted in ``asked``."""

    def __init__(self, asked: list[str]) -> None:
        self.asked = asked

    def __getattr__(self, name: str) -> Any:
        self.asked.append(name)
        raise AssertionError(f"{name} asked through the cluster's lost head")


def test_without_the_head_cleanup_asks_nothing_through_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cluster's head lost mid-run: the run's cleanup asks nothing of Ray (its
    supervisors, ending them), which blocked until Ray ended the process with no JSON
    printed; the supervisors are forgotten (Ray ends them with the head)."""
    import ray

    from runtime_cupy.hosts.ray import session
    from runtime_cupy.hosts.ray.host import RayHost

    asked: list[str] = []
    node = cpu_stage_nodes(live_hosts([_node("a", "127.0.0.1", 1)]), 1)[0]
    host = RayHost([node], "127.0.0.1")
    host._actors[node.node_id] = _Unreachable(asked)
    monkeypatch.setattr(session, "head_answers", lambda: False, raising=False)
    for name in ("kill", "wait", "get"):
        monkeypatch.setattr(ray, name, lambda *_a, name=name, **_k: asked.append(name))
    host._release(node.node_id, host._actors[node.node_id])  # a warm stage gone
    host._actors[node.node_id] = _Unreachable(asked)
    with contextlib.suppress(AssertionError):
        host.cleanup("run-without-head", [1, 2])
    assert asked == [] and host._actors == {}


def test_connecting_keeps_the_commands_sigterm_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ray.init`` sets its own SIGTERM handler (``sys.exit``) for the rest of the
    process: connecting gives back the one the command had (SIGTERM as Ctrl-C: the
    ``Cancelled`` object, exit 143) or an ignored SIGTERM, and leaves Ray's where the
    process had the default action."""
    import signal

    import ray

    from runplan.interrupted import raise_interrupted
    from runtime_cupy.hosts.ray import session

    def rays_exit(signum: int, _frame: object) -> None:
        raise SystemExit(signum)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **_k: signal.signal(signal.SIGTERM, rays_exit))
    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, raise_interrupted)
        session.connect("auto")
        assert signal.getsignal(signal.SIGTERM) is raise_interrupted
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        session.connect("auto")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        session.connect("auto")
        assert signal.getsignal(signal.SIGTERM) is rays_exit
    finally:
        signal.signal(signal.SIGTERM, before)


def test_auto_with_no_cluster_here_says_how_to_start_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--ray-address auto`` with no cluster on this machine (and no ``RAY_ADDRESS``) is
    refused in our flags' terms: Ray's own text tells the user to set an ``--address``
    flag that our commands do not have."""
    import ray

    from runtime_cupy.hosts.ray import session

    def no_instance(**_k: object) -> None:
        raise ConnectionError(
            "Could not find any running Ray instance. Please specify the one to connect to "
            "by setting `--address` flag or `RAY_ADDRESS` environment variable."
        )

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_instance)
    with pytest.raises(ClusterError) as refused:
        session.connect("auto")
    said = str(refused.value)
    assert "no Ray cluster is running on this machine" in said, said
    assert "ray start --head" in said and "--ray-address HOST:PORT" in said, said
    assert "`--address`" not in said, said
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")  # Ray's cluster, not this machine's
    with pytest.raises(ClusterError, match="cannot connect to the Ray cluster at 'auto'"):
        session.connect("auto")
