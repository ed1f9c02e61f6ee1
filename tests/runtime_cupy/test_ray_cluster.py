"""Stages on the nodes of a Ray cluster (a one-machine cluster of three Ray nodes,
``ray.cluster_utils.Cluster``): the node pool from the cluster, one supervisor actor
per stage on the Ray node its plan names, the tokens of ``runtime_sim`` (NumPy worker)
over shared memory and over TCP edges found through Ray's key-value store, the default
(CPU) worker's tokens as on local processes, ``python -m runtime_cupy plan`` against the
cluster, a stage SIGKILLed mid-decode, and ``python -m runtime_cupy serve
--ray-address`` keeping its stages warm on the cluster (the official ``openai`` client on
loopback). After each run: no stage process, no supervisor, no segment, no run folder,
no address of the run left in the store; after the server, nothing of it."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

ray = pytest.importorskip("ray", reason="the Ray host needs Ray (the test extra has it)")

import runtime_sim  # noqa: E402
from runplan.config import Timeouts  # noqa: E402
from runtime_cupy import generate  # noqa: E402
from runtime_cupy.cli.main import main as cli_main  # noqa: E402
from runtime_cupy.hosts.ray.cluster import ClusterError  # noqa: E402
from runtime_cupy.hosts.ray.rendezvous import NAMESPACE, run_prefix  # noqa: E402
from runtime_cupy.hosts.ray.session import connect  # noqa: E402
from tests.support.hygiene import (  # noqa: E402
    alive,
    run_resources,
    wait_gone,
)
from tests.support.ray_checks import (  # noqa: E402
    SUPERVISOR_TITLE,
    cmdline,
    ppid,
    run_processes,
    supervisors,
    wait_until,
)
from tests.support.ray_local_cluster import local_cluster  # noqa: E402
from tests.support.servers import ServerProcess, metrics, wait_for  # noqa: E402

#: A Ray cluster of its own and real stage processes (make fast leaves these out).
pytestmark = [pytest.mark.ray, pytest.mark.process]

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with local_cluster(nodes=2) as c:
        yield c


def _raylets(cluster: Any) -> dict[int, str]:
    """The pid of each Ray node's raylet -> that node's id."""
    from ray._private import ray_constants

    out = {}
    for node in cluster.list_all_nodes():
        info = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0]
        out[info.process.pid] = node.node_id
    return out


class Spawned:
    """The Ray node under which each stage process started (its supervisor's raylet)."""

    def __init__(self, raylets: dict[int, str]) -> None:
        self.raylets = raylets
        self.nodes: dict[int, str | None] = {}

    def on_event(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "spawned":
            supervisor = ppid(int(fields["pid"]))
            self.nodes[int(fields["stage_index"])] = self.raylets.get(ppid(supervisor))


def _store_left(run_id: str) -> list[str]:
    from ray.experimental import internal_kv

    return list(internal_kv._internal_kv_list(run_prefix(run_id), namespace=NAMESPACE))


def _assert_clean(run_id: str) -> None:
    assert wait_until(lambda: run_processes(run_id), 10) == []
    assert wait_until(supervisors, 20) == []
    assert run_resources(run_id) == []
    assert _store_left(run_id) == []


@pytest.mark.parametrize("edges", ["auto", "tcp"])
def test_three_stages_on_three_ray_nodes_give_the_simulators_tokens(
    cluster: Any, tiny: str, edges: str
) -> None:
    spawned = Spawned(_raylets(cluster))
    result = generate(
        tiny,
        PROMPT,
        stages=3,
        max_tokens=8,
        worker="numpy",
        ray_address=cluster.address,
        edges=edges,
        on_event=spawned.on_event,
    )
    expected = runtime_sim.generate(tiny, PROMPT, stages=3, max_tokens=8)  # NumPy worker
    assert result.outcome == "completed", result.fault
    assert result.tokens == expected.tokens
    hosts = [s.host for s in result.stages]
    assert len(set(hosts)) == 3 and all(h and "#" in h for h in hosts), hosts
    assert [s.node_id for s in result.plan.stages] == [f"{h}/cpu0" for h in hosts]
    # Each stage process ran under the Ray node its plan names, one per node.
    ray_nodes = {h.label: h.ray_node_id for h in _cluster_hosts()}
    assert spawned.nodes == {i: ray_nodes[h] for i, h in enumerate(hosts)}
    # One machine: shared memory where asked for nothing else; TCP when forced.
    assert set(result.media) == {"shm" if edges == "auto" else "tcp"}
    assert all(s.returncode == 0 for s in result.stages)
    _assert_clean(result.chain_id)


def test_the_default_cpu_worker_on_the_cluster_gives_its_local_tokens(
    cluster: Any, tiny: str
) -> None:
    """The default worker (the CPU worker, compiled kernels) runs in the cluster's stage
    processes too: the same tokens as three local stage processes of that worker."""
    on_cluster = generate(tiny, PROMPT, stages=3, max_tokens=8, ray_address=cluster.address)
    local = generate(tiny, PROMPT, stages=3, max_tokens=8, worker="cpu")
    assert on_cluster.outcome == "completed", on_cluster.fault
    assert local.outcome == "completed", local.fault
    assert len(on_cluster.tokens) == 8
    assert on_cluster.tokens == local.tokens
    assert len({s.host for s in on_cluster.stages}) == 3
    _assert_clean(on_cluster.chain_id)


def _cluster_hosts() -> Any:
    from runtime_cupy.hosts.ray.session import hosts

    return hosts()


def test_plan_prints_the_plan_against_the_live_cluster(
    cluster: Any, tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(
        ["plan", "--model", tiny, "--ray-address", cluster.address, "--stages", "4",
         "--placement", "memory", "--json"]
    )  # fmt: skip
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    stages = doc["stages"]
    labels = sorted(h.label for h in _cluster_hosts())
    # Four stages on three Ray nodes: the first node holds two, consecutive.
    assert [s["host"] for s in stages] == [labels[0], labels[0], labels[1], labels[2]]
    assert [s["node_id"] for s in stages] == [
        f"{labels[0]}/cpu0", f"{labels[0]}/cpu1", f"{labels[1]}/cpu0", f"{labels[2]}/cpu0"
    ]  # fmt: skip
    memory = {n["NodeID"]: n["Resources"]["memory"] for n in ray.nodes() if n["Alive"]}
    assert all(s["host_memory_bytes"] == int(memory[s["ray_node_id"]]) for s in stages)
    ranges = [(s["layer_start"], s["layer_end_exclusive"]) for s in stages]
    assert ranges[0][0] == 0 and ranges[-1][1] == 4
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert [s["stage_index"] for s in doc["plan"]["stages"]] == [0, 1, 2, 3]


def test_a_stage_killed_mid_decode_ends_the_run_naming_it_and_its_host(
    cluster: Any, tiny: str
) -> None:
    tokens: list[int] = []
    pids: dict[int, int] = {}

    def on_event(kind: str, fields: dict[str, Any]) -> None:
        if kind == "spawned":
            pids[int(fields["stage_index"])] = int(fields["pid"])

    def on_token(token: int) -> None:
        tokens.append(token)
        if len(tokens) == 2:
            os.kill(pids[1], signal.SIGKILL)

    result = generate(
        tiny,
        PROMPT,
        stages=3,
        max_tokens=40,
        worker="numpy",
        ray_address=cluster.address,
        edges="tcp",
        on_event=on_event,
        on_token=on_token,
    )
    assert result.outcome == "faulted"
    assert result.fault_stage == 1
    host = result.stages[1].host
    node = result.plan.stages[1].node_id
    assert result.fault is not None and "\n" not in result.fault
    assert f"stage 1 (node {node}, host {host})" in result.fault, result.fault
    assert "killed by SIGKILL" in result.fault, result.fault
    codes = {s.stage_index: s.returncode for s in result.stages}
    assert codes[1] == -signal.SIGKILL and codes[0] == 0 and codes[2] == 0, codes
    assert len(result.tokens) < 40
    _assert_clean(result.chain_id)


def test_a_stage_stopped_mid_decode_is_named_silent_with_its_host(cluster: Any, tiny: str) -> None:
    """SIGSTOP: the stage lives, its control connection stays up (no keepalive fails on
    one machine), only its heartbeats stop; the run names it within the bound and its
    supervisor kills it."""
    tokens: list[int] = []
    pids: dict[int, int] = {}

    def on_event(kind: str, fields: dict[str, Any]) -> None:
        if kind == "spawned":
            pids[int(fields["stage_index"])] = int(fields["pid"])

    def on_token(token: int) -> None:
        tokens.append(token)
        if len(tokens) == 2:
            os.kill(pids[1], signal.SIGSTOP)

    result = generate(
        tiny,
        PROMPT,
        stages=2,
        max_tokens=40,
        worker="numpy",
        ray_address=cluster.address,
        timeouts=Timeouts(heartbeat_ms=2_000),
        on_event=on_event,
        on_token=on_token,
    )
    assert result.outcome == "faulted" and result.fault_stage == 1, result.fault
    host = result.stages[1].host
    node = result.plan.stages[1].node_id
    silent = f"stage 1 (node {node}, host {host}): stage_silent: stage 1 on '{node}': no heartbeat"
    assert result.fault is not None and silent in result.fault, result.fault
    codes = {s.stage_index: s.returncode for s in result.stages}
    assert codes == {0: 0, 1: -signal.SIGKILL}, codes
    _assert_clean(result.chain_id)


def test_no_cluster_at_the_address_is_a_clear_error() -> None:
    with pytest.raises(ClusterError, match=r"no Ray cluster at 127\.0\.0\.1:1"):
        connect("127.0.0.1:1")


@pytest.mark.parametrize("port", ["0", "65536", "99999", "0099999"])
def test_a_port_outside_1_to_65535_is_refused_naming_it(port: str) -> None:
    """A port no socket has: refused naming it (99999 was probed as 99999 mod 65536)."""
    with pytest.raises(ClusterError) as exc:
        connect(f"127.0.0.1:{port}")
    assert str(exc.value) == f"bad Ray address '127.0.0.1:{port}': port {port} is not in 1..65535"


@pytest.mark.parametrize("answer", [None, b"HTTP/1.0 400 Bad request\r\n\r\n"])
def test_a_listener_that_is_not_a_ray_head_is_a_clear_error_at_once(
    answer: bytes | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port where something other than a Ray head listens (a silent listener, an HTTP
    server): refused within the probe's bound, naming the address (``ray.init`` retried
    for minutes). The head's own answer (gRPC's SETTINGS frame) is the cluster tests'."""
    from runtime_cupy.hosts.ray import session

    monkeypatch.setattr(session, "PROBE_S", 1.0)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        address = f"127.0.0.1:{listener.getsockname()[1]}"

        def answers() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(64)
                if answer is not None:
                    conn.sendall(answer)
                time.sleep(3)

        thread = threading.Thread(target=answers, daemon=True)
        thread.start()
        began = time.monotonic()
        with pytest.raises(ClusterError, match=f"no Ray cluster at {address}: what listens"):
            connect(address)
        # A bound on Ray's minutes of retries, not a timing: the probe's 1 s plus a
        # loaded host's slack.
        assert time.monotonic() - began < 30
        thread.join(5)


def test_serve_refuses_what_a_cluster_cannot_take(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No cluster at the address, or one-host flags with it: a one-line error, exit 2,
    before any stage or server starts."""
    from runtime_cupy.cli.serve import main as serve_main

    assert serve_main(["--model", tiny, "--ray-address", "127.0.0.1:1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "error: no Ray cluster at 127.0.0.1:1" in err and "Traceback" not in err, err
    for flags in (["--gpus", "0"], ["--log-dir", "."]):
        assert serve_main(["--model", tiny, "--ray-address", "auto", *flags]) == 2
        err = capsys.readouterr().err
        assert "give no host, gpus (--gpus) or log_dir (--log-dir)" in err, err


def test_the_cli_runs_on_the_cluster_and_its_json_names_each_stages_host(
    cluster: Any, tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(
        ["--model", tiny, "--ray-address", cluster.address, "--stages", "2", "--worker",
         "numpy", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"]
    )  # fmt: skip
    doc = json.loads(capsys.readouterr().out)  # exactly one object on stdout
    assert code == 0 and doc["outcome"] == "completed", doc
    assert doc["tokens"] == list(runtime_sim.generate(tiny, PROMPT, stages=2, max_tokens=4).tokens)
    labels = {h.label for h in _cluster_hosts()}
    hosts = [s["host"] for s in doc["stages"]]
    assert len(set(hosts)) == 2 and set(hosts) <= labels, hosts
    assert [s["node_id"] for s in doc["stages"]] == [f"{h}/cpu0" for h in hosts]
    _assert_clean(doc["chain_id"])


# -- warm stages on the cluster: python -m runtime_cupy serve --ray-address ---------------
SERVE_STAGES = 2
SERVE_WORKER = "numpy"


def _stage_lines(server: ServerProcess, pid: int, text: str) -> int:
    """How many times stage process ``pid`` logged ``text`` (its log reaches the
    server's standard error through Ray's log streaming)."""
    return len(re.findall(rf"pid {pid}\) INFO {re.escape(text)}", server.log()))


def _logged(server: ServerProcess, pid: int, text: str, times: int) -> bool:
    with contextlib.suppress(AssertionError):
        wait_for(lambda: _stage_lines(server, pid, text) >= times, 30.0, text)
    return _stage_lines(server, pid, text) == times


def _supervisor_node(pid: int, raylets: dict[int, str]) -> str | None:
    """The Ray node whose raylet started the supervisor of stage process ``pid``."""
    supervisor = ppid(pid)
    assert SUPERVISOR_TITLE in cmdline(supervisor), cmdline(supervisor)
    return raylets.get(ppid(supervisor))


def test_serve_keeps_its_stages_warm_on_the_cluster(
    cluster: Any, tiny: str, tmp_path: Path
) -> None:
    """``serve --ray-address`` (TCP edges found through Ray's store, every run anew):
    the same stage processes (on the Ray nodes their plan names) answer the official
    client's requests, bound once, with the tokens of
    ``generate(..., ray_address=...)``; a stage SIGKILLed between two requests is
    started again on its node and the next request succeeds; once the server stops,
    nothing of it is left on the cluster."""
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}  # every stage's log line, as written
    args = ["--model", tiny, "--stages", str(SERVE_STAGES), "--worker", SERVE_WORKER,
            "--ray-address", cluster.address, "--edges", "tcp", "--port", "0", "--context", "64",
            "-v"]  # fmt: skip
    server = ServerProcess(args, tmp_path / "server.log", env)
    stopped = False
    try:
        server.wait_listening(120.0)
        server.wait_ready(180.0)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
        model = client.models.list().data[0].id
        pids = server.stage_pids()
        assert sorted(pids) == list(range(SERVE_STAGES)), server.log()
        raylets = _raylets(cluster)
        nodes = {i: _supervisor_node(pid, raylets) for i, pid in pids.items()}
        assert len(set(nodes.values())) == SERVE_STAGES and None not in nodes.values(), nodes

        def ask() -> str:
            answer = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=8, temperature=0
            )
            return answer.choices[0].text

        first, second = ask(), ask()
        expected = generate(tiny, PROMPT, stages=SERVE_STAGES, max_tokens=8,
                            worker=SERVE_WORKER, ray_address=cluster.address)  # fmt: skip
        assert expected.outcome == "completed", expected.fault
        assert first == second == expected.text
        assert server.stage_pids() == pids and all(alive(p) for p in pids.values())
        # Bound once (the chain's start), then each request reused the weights.
        for pid in pids.values():
            assert _logged(server, pid, "bound weights in", 1), server.log()
            assert _logged(server, pid, "weights reused", 2), server.log()

        os.kill(pids[1], signal.SIGKILL)
        assert not wait_gone([pids[1]], 10.0)
        assert ask() == expected.text
        again = server.stage_pids()
        assert not set(again.values()) & set(pids.values())  # the whole chain started again
        assert _supervisor_node(again[1], raylets) == nodes[1]  # the node its plan names
        server.wait_ready()
        assert metrics(server.base_url)["gguf_pipeline_stage_restarts_total"] >= 1
        live = list(again.values())
        assert server.stop() == 143, server.log()  # 128 + SIGTERM
        stopped = True
        assert not wait_gone(live, 10.0), "stage processes outlived the server"
        assert wait_until(supervisors, 20) == []
        # A run per request. Its id stays in the server (the log names its label), and its
        # TCP edges found each other through Ray's store, not /dev/shm or /tmp: what is
        # left of its runs would be there (the store of this test's own cluster).
        assert len(set(server.run_labels())) >= 3, server.log()
        from ray.experimental import internal_kv

        left = internal_kv._internal_kv_list(b"edge/", namespace=NAMESPACE)  # any run's
        assert left == [], "addresses of the server's runs left in Ray's store"
        with pytest.raises(OSError):  # nothing listens where the server did
            socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1])), 2)
    finally:
        if not stopped:
            server.stop()


def test_chat_keeps_its_stages_on_the_cluster(cluster: Any, tmp_path: Path) -> None:
    """``chat --ray-address``: a turn typed in the terminal is answered by stages on the
    cluster with ``generate(..., ray_address=...)``'s text; ``/exit`` leaves with status 0
    and ends every stage and supervisor."""
    from runplan.models import resolve_model
    from runtime_core.tokenizer import Tokenizer
    from runtime_cupy.serve.prompts import chat_prompt
    from runtime_cupy.serve.requests import Message
    from tests.fixtures.gguf_models import ModelShape, write_model
    from tests.runtime_cupy.serve.test_chat import Terminal

    template = Tokenizer.from_gguf(resolve_model("smollm2-135m")).vocab.chat_template
    assert template is not None
    model = str(
        write_model(
            tmp_path / "tiny-chat.gguf",
            ModelShape(n_layers=4, context_length=256),
            extra_keys={"tokenizer.chat_template": template},
        )
    )
    ids = chat_prompt(Tokenizer.from_gguf(model), [Message("user", "hello")])
    expected = generate(model, ids, stages=SERVE_STAGES, max_tokens=8, worker=SERVE_WORKER,
                        ray_address=cluster.address)  # fmt: skip
    assert expected.outcome == "completed", expected.fault
    argv = [sys.executable, "-m", "runtime_cupy", "chat", "--model", model, "--stages",
            str(SERVE_STAGES), "--worker", SERVE_WORKER, "--max-tokens", "8",
            "--ray-address", cluster.address]  # fmt: skip
    term = Terminal(argv)
    term.read_until(b"> ", 0)
    assert term.say("hello") == expected.text
    assert len(supervisors()) == SERVE_STAGES  # the chat's, on the cluster
    term.type(b"/exit\r")
    assert term.wait() == 0, term.text()
    assert wait_until(supervisors, 20) == []


def test_a_warm_stage_killed_in_a_request_names_itself_and_comes_back(
    cluster: Any, tiny: str
) -> None:
    """A warm stage on the cluster SIGKILLed mid-decode ends that run alone, with a
    fault naming the stage, its node, its host and the cause; the next run starts it
    again (on its node) and completes; closing the chain ends every supervisor."""
    from runtime_cupy.serve.chain import WarmChain

    with WarmChain(tiny, stages=SERVE_STAGES, worker=SERVE_WORKER, context=64,
                   ray_address=cluster.address) as chain:  # fmt: skip
        pids = chain.pids()
        tokens: list[int] = []

        def on_token(token: int) -> None:
            tokens.append(token)
            if len(tokens) == 2:
                os.kill(pids[1], signal.SIGKILL)

        broken = chain.generate(PROMPT, max_tokens=30, on_token=on_token).result
        assert broken.outcome == "faulted" and broken.fault_stage == 1
        node = chain.layout[1][1]
        host = broken.stages[1].host
        assert host is not None and node.startswith(host), (node, host)
        assert f"stage 1 (node {node}, host {host})" in (broken.fault or ""), broken.fault
        assert "killed by SIGKILL" in (broken.fault or ""), broken.fault
        after = chain.generate(PROMPT, max_tokens=4)
        assert after.result.outcome == "completed", after.result.fault
        assert after.restarted == (0, 1)  # a chain fault: the whole chain starts again
        again = chain.pids()
        assert not set(again) & set(pids)
        assert after.result.stages[1].host == host
    assert wait_until(supervisors, 20) == []
