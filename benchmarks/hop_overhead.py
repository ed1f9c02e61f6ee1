"""Hop overhead of the process runtime: time per decoded token through 1, 2 and 4 stage
processes on one model (NumPy worker), over shared-memory edges and over TCP edges on
loopback (authenticated, the default, and encrypted, ``--encrypt-edges``), and the
overhead per hop per token derived from them for each.

    python benchmarks/hop_overhead.py [--model PATH|smollm2-135m] [--tokens 200]
                                      [--repeat 3] [--edges shm,tcp,tcp-encrypted] [--json]

What sealing a TCP edge's frames costs per hop is measured three ways, side by side for
plain frames (which only this script makes: ``PLAIN``; the runtime always seals),
authenticated ones (HMAC-SHA256) and encrypted ones (AES-256-GCM): the seals alone in
this process (a decode step's record sealed and opened, and its credit back); a bare
ring hop between two processes; and, for the two the runtime offers, the slope of whole
runs, with the paired difference of encrypted over authenticated runs of the same split
back to back.

A decode token crosses ``stages + 1`` hops (orchestrator -> stage 0 -> ... -> stage
N-1 -> orchestrator) and the model's blocks are the same whatever the split, so the
slope of time per token against hops is what one more hop costs: a shared-memory
record written, a process woken, the record validated and fed through the stage state
machine, one more worker call over the same blocks. The time per token is the median
interval between consumed decode tokens at the orchestrator, over ``--repeat`` rounds
that run 1, 2 and 4 stages over each medium in turn (so that the load of a shared
machine falls on all of them alike). A TCP hop costs what a shared-memory hop costs
plus the stream: a send, the kernel's loopback, a receive, and a credit back.

For scale, the same splits' worker steps are also timed in this one process (the sum
over stages of each decode step, no processes, no rings, no state machines): what a
token costs beyond them, divided by its hops, is the runtime's overhead per hop at that
stage count. Every stage uses one BLAS thread (and so does this process), so the
compute is the same at every stage count; stages are never busy at once (one token is
in flight).

Where ``/proc/<pid>/schedstat`` exists (Linux), it also gives where the time goes: the
CPU time per decoded token of the orchestrator's thread and of each stage process,
next to that stage's worker step timed alone in this process. What a stage spends
beyond its step is its share of a hop: the wake-up, the control path (validation, the
state machine, timers, publishing, release) and its worker running slower in a process
that slept while the others ran (caches taken by the other processes).

By default the model is a random-weight llama of 4 blocks, 256 wide (written to a
temporary folder by the test-model generator), whose steps are short enough that the
hops show. Last, the floor: a bare ring hop between two processes (publish, wake-up,
acquire), over each medium, with the receiver busy just before and after it slept 2 ms,
as a stage of a pipeline sleeps while the other stages work. Targets (issue 12): a
shared-memory hop under 200 us per decoded token, a TCP hop at most 100 us more.
"""

from __future__ import annotations

import os

# Before NumPy loads (here and, inherited, in every stage process): one BLAS thread.
for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from runplan import RingSpec, SamplingConfig, provision_all  # noqa: E402
from runplan.models import resolve_model  # noqa: E402
from runplan.plan import OBJECT_HEADER_BYTES  # noqa: E402
from runtime_core.workers.interface import TokenOutput  # noqa: E402
from runtime_core.workers.reference.worker import ReferenceWorker  # noqa: E402
from runtime_cupy import generate  # noqa: E402
from runtime_cupy.api import plan_for  # noqa: E402
from runtime_cupy.edges.port import EdgeMedium, ProcessRing  # noqa: E402
from runtime_cupy.edges.tcp import TcpMedium  # noqa: E402
from runtime_cupy.edges.tcp_frames import CREDIT, FRAME, RECORD  # noqa: E402
from runtime_cupy.edges.tcp_seal import (  # noqa: E402
    AUTHENTICATED,
    ENCRYPTED,
    Body,
    FrameSeal,
    Protection,
)
from runtime_cupy.hosts.local import LOOPBACK, FileRendezvous, local_medium  # noqa: E402
from runtime_cupy.process.keys import edge_key, new_secret  # noqa: E402
from runtime_cupy.process.names import new_run_id  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fixtures.gguf_models import ModelShape, write_model  # noqa: E402

STAGES = (1, 2, 4)
PROMPT = [1, 2, 3, 4]
#: The edges a run can take: the runtime's media, and TCP encrypted.
VARIANTS = ("shm", "tcp", "tcp-encrypted")


class _PlainSeal:
    """No seal at all: what a TCP frame cost before frames were sealed (this script's
    only; the runtime offers no such edge)."""

    tag_bytes = 0

    def seal(self, head: bytes, body: Body) -> tuple[Body, bytes]:
        return body, b""

    def open(self, head: bytes, body: memoryview, tag: bytes) -> bool:
        return True


def _plain(_key: bytes, _direction: int) -> FrameSeal:
    return _PlainSeal()


PLAIN = Protection(0, "plain (this benchmark only)", _plain)
PROTECTIONS = {"plain": PLAIN, "authenticated": AUTHENTICATED, "encrypted": ENCRYPTED}
#: The bare hop's medium of each.
BARE = {"plain": "tcp-plain", "authenticated": "tcp", "encrypted": "tcp-encrypted"}


def bench_medium(name: str) -> EdgeMedium:
    """A medium for the bare hop: ``shm``, ``tcp`` (authenticated), ``tcp-encrypted`` or
    ``tcp-plain``."""
    if name == "tcp-plain":
        return TcpMedium(FileRendezvous(), LOOPBACK, protection=PLAIN)
    return local_medium(name.removesuffix("-encrypted"), name.endswith("-encrypted"))


def seal_us(protection: Protection, record_bytes: int, rounds: int = 3000) -> float:
    """Microseconds the seals of one hop take in this process (median of ``rounds``): a
    decode step's record sealed by its producer and opened by its consumer, and the
    credit for it sealed and opened on the way back."""
    key, nonce_c, nonce_p = new_secret(), new_secret(), new_secret()
    p_send, p_receive = protection.seals(key, nonce_c, nonce_p, producer=True)
    c_send, c_receive = protection.seals(key, nonce_c, nonce_p, producer=False)
    record = bytes(record_bytes)
    head, credit = FRAME.pack(RECORD, record_bytes), FRAME.pack(CREDIT, 1)
    times = []
    for _ in range(rounds):
        began = time.perf_counter_ns()
        body, tag = p_send.seal(head, record)
        assert c_receive.open(head, memoryview(bytearray(body)), tag)
        _, tag = c_send.seal(credit, b"")
        assert p_receive.open(credit, memoryview(bytearray()), tag)
        times.append((time.perf_counter_ns() - began) / 1000)
    return statistics.median(times)


def cpu_ns(pid: int) -> int | None:
    """Nanoseconds process ``pid``'s main thread has run on a CPU (Linux), else None."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Run:
    """One process run: the intervals between its decode tokens, and the CPU time per
    decode token of the orchestrator (this thread) and of each stage process (from the
    first decode token to the last, where /proc/<pid>/schedstat exists)."""

    def __init__(self, model: str, stages: int, tokens: int, variant: str) -> None:
        self.stamps: list[float] = []
        self.pids: dict[int, int] = {}
        self.cpu: list[tuple[int, list[int | None]]] = []  # (orchestrator, stages) twice
        self.tokens = tokens
        edges = variant.removesuffix("-encrypted")
        result = generate(
            model,
            PROMPT,
            stages=stages,
            max_tokens=tokens,
            on_token=self._token,
            on_event=self._event,
            edges=edges,
            encrypt_edges=variant.endswith("-encrypted"),
        )
        if result.outcome != "completed" or len(self.stamps) < 3:
            raise SystemExit(f"{stages} stages over {variant}: {result.outcome} {result.fault}")
        if set(result.media) != {edges}:
            raise SystemExit(f"asked for {edges} edges, the run used {result.media}")

    def _event(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "spawned":
            self.pids[fields["stage_index"]] = fields["pid"]

    def _token(self, _token_id: int) -> None:
        self.stamps.append(time.perf_counter())
        if len(self.stamps) in (2, self.tokens):  # the first and the last decode token
            stages = [cpu_ns(self.pids[i]) for i in sorted(self.pids)]
            self.cpu.append((time.thread_time_ns(), stages))

    def intervals_us(self) -> list[float]:
        """Microseconds between consecutive decode tokens."""
        return [float(d) * 1e6 for d in np.diff(self.stamps[1:])]

    def cpu_us(self) -> tuple[float, list[float]] | None:
        """CPU microseconds per decode token: the orchestrator's, each stage's."""
        if len(self.cpu) != 2 or None in self.cpu[0][1] + self.cpu[1][1]:
            return None
        (o0, s0), (o1, s1) = self.cpu
        n = self.tokens - 2
        stages = [(b - a) / n / 1000 for a, b in zip(s0, s1, strict=True)]  # type: ignore[operator]
        return (o1 - o0) / n / 1000, stages


def worker_us(model: str, stages: int, tokens: int) -> tuple[float, list[float]]:
    """Median over decode tokens of the summed worker steps of ``stages`` stages, all
    in this process, and the median of each stage's step."""
    plan, _ = plan_for(
        model,
        stages=stages,
        prompt_len=len(PROMPT),
        max_tokens=tokens,
        sampling=SamplingConfig(),
        return_logits=False,
    )
    workers = []
    for provision in provision_all(plan):
        worker = ReferenceWorker()
        worker.configure(provision)
        worker.bind(provision.gguf_source)
        workers.append(worker)
    sums = []
    steps: list[list[float]] = [[] for _ in workers]
    data: object = np.array(PROMPT, np.uint32)
    for sequence in range(tokens):
        began = step_began = time.perf_counter()
        for worker, times in zip(workers, steps, strict=True):
            data = worker.execute_step(sequence, data)  # type: ignore[arg-type]
            step_ended = time.perf_counter()
            times.append((step_ended - step_began) * 1e6)
            step_began = step_ended
        if sequence > 0:
            sums.append((time.perf_counter() - began) * 1e6)
        assert isinstance(data, TokenOutput)
        data = np.array([data.token_id], np.uint32)
    return statistics.median(sums), [statistics.median(t[1:]) for t in steps]


def _opened(
    make: Callable[[], ProcessRing | None], serve: ProcessRing, timeout_s: float = 30
) -> ProcessRing:
    """``make()`` until it gives a ring, serving ``serve`` meanwhile (a TCP consumer's
    handshakes), as a stage's loop would."""
    deadline = time.monotonic() + timeout_s
    while (ring := make()) is None:
        if time.monotonic() > deadline:
            raise SystemExit("the bare hop's rings never connected")
        serve._data.wait(0.002)
    return ring


def raw_hop_us(medium_name: str, idle_us: float, rounds: int = 400) -> float:
    """Median one-way latency of a bare ring hop between two processes over one medium
    (publish, wake-up, acquire; no validation, no state machine) when the receiver has
    slept ``idle_us`` before the record comes: the floor under every hop on this host."""
    spec = RingSpec(slot_count=2, alignment=64, slot_bytes=256)
    run_id = new_run_id("hop-bench")
    secret = new_secret()
    medium = bench_medium(medium_name)

    def key(edge: int) -> bytes:
        return edge_key(secret, run_id, edge)

    back = medium.create(run_id, 2, spec, key(2))  # this process consumes the answers
    pid = os.fork()
    if pid == 0:  # the receiver: consumes edge 1, stamps, answers on edge 2
        there = medium.create(run_id, 1, spec, key(1))
        answer = _opened(lambda: medium.attach(run_id, 2, spec, key(2)), there)
        for _ in range(rounds):
            slot = there.wait_acquire(30)
            stamp = time.perf_counter_ns()
            there.release(slot)
            out = answer.wait_reserve(30)
            answer.slot(out)[:8] = stamp.to_bytes(8, "little")
            answer.publish(out)
        answer.detach()
        there.detach()
        os._exit(0)
    try:
        send = _opened(lambda: medium.attach(run_id, 1, spec, key(1)), back)
        latencies = []
        for _ in range(rounds):
            until = time.perf_counter_ns() + idle_us * 1000
            while time.perf_counter_ns() < until:  # busy here while the receiver sleeps
                pass
            reserved = send.wait_reserve(30)
            sent = time.perf_counter_ns()
            send.publish(reserved)
            got = back.wait_acquire(30)
            latencies.append((int.from_bytes(back.slot(got)[:8], "little") - sent) / 1000)
            back.release(got)
        os.waitpid(pid, 0)
        send.detach()
        return statistics.median(latencies)
    finally:
        back.detach()
        for edge in (1, 2):
            medium.remove(run_id, edge)


def medium_report(
    medium: str,
    intervals: dict[int, list[float]],
    cpu: dict[int, list[tuple[float, list[float]]]],
    compute: dict[int, tuple[float, list[float]]],
    slopes: list[float],
) -> dict[str, Any]:
    """The rows, the slope over hops and the bare hops of one medium."""
    rows = []
    for n in STAGES:
        median = statistics.median(intervals[n])
        rows.append(
            {
                "stages": n,
                "hops": n + 1,
                "median_us": median,
                "p10_us": float(np.percentile(intervals[n], 10)),
                "p90_us": float(np.percentile(intervals[n], 90)),
                "decode_tokens": len(intervals[n]),
                "worker_us": compute[n][0],
                "worker_stage_us": compute[n][1],
                "beyond_worker_per_hop_us": (median - compute[n][0]) / (n + 1),
                # CPU per decode token, median over rounds (None without /proc)
                "cpu_orchestrator_us": (
                    statistics.median(c[0] for c in cpu[n]) if cpu[n] else None
                ),
                "cpu_stage_us": (
                    [statistics.median(c[1][i] for c in cpu[n]) for i in range(n)]
                    if cpu[n]
                    else None
                ),
            }
        )
    slope, intercept = _slope({n: statistics.median(intervals[n]) for n in STAGES})
    raw = {idle: raw_hop_us(medium, idle) for idle in (0, 2000)}
    return {
        "rows": rows,
        "overhead_per_hop_us": slope,
        "fit_intercept_us": intercept,
        "round_slopes_us": slopes,
        "bare_hop_us": {"receiver_busy": raw[0], "receiver_idle_2ms": raw[2000]},
    }


def _slope(per_stages: dict[int, float]) -> tuple[float, float]:
    hops = np.array([n + 1 for n in per_stages], dtype=float)
    times = np.array(list(per_stages.values()))
    slope, intercept = np.polyfit(hops, times, 1)
    return float(slope), float(intercept)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or bundled model name")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per run (200)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of 1, 2, 4 stages (3)")
    parser.add_argument(
        "--edges",
        default=",".join(VARIANTS),
        help=f"edges, in turn ({','.join(VARIANTS)})",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    media = [m for m in args.edges.split(",") if m]
    unknown = [m for m in media if m not in VARIANTS]
    if unknown:
        parser.error(f"unknown edges {unknown} (of {', '.join(VARIANTS)})")
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model(args.model) if args.model else None
        if model is None:
            shape = ModelShape(n_layers=4, hidden=256, heads=4, heads_kv=2, ffn=512)
            model = str(write_model(Path(tmp) / "hop.gguf", shape))
        intervals: dict[str, dict[int, list[float]]] = {m: {n: [] for n in STAGES} for m in media}
        cpu: dict[str, dict[int, list[tuple[float, list[float]]]]] = {
            m: {n: [] for n in STAGES} for m in media
        }
        slopes: dict[str, list[float]] = {m: [] for m in media}
        paired: list[float] = []  # per round and split: (tcp - shm) / hops
        paired_cpu: list[float] = []  # per round, split and stage: tcp - shm CPU per token
        sealed: list[float] = []  # per round and split: (encrypted - authenticated) / hops
        sealed_cpu: list[float] = []  # per round, split and stage: the same, CPU per token
        load_before = os.getloadavg()
        for _ in range(args.repeat):
            medians: dict[str, dict[int, float]] = {m: {} for m in media}
            used_by: dict[str, dict[int, tuple[float, list[float]] | None]] = {m: {} for m in media}
            for medium in media:  # interleaved: each round runs every medium and split
                for n in STAGES:
                    run = Run(model, n, args.tokens, medium)
                    intervals[medium][n] += run.intervals_us()
                    medians[medium][n] = statistics.median(run.intervals_us())
                    used_by[medium][n] = used = run.cpu_us()
                    if used is not None:
                        cpu[medium][n].append(used)
                slopes[medium].append(_slope(medians[medium])[0])
            if "shm" in media and "tcp" in media:
                for n in STAGES:
                    paired.append((medians["tcp"][n] - medians["shm"][n]) / (n + 1))
                    a, b = used_by["shm"][n], used_by["tcp"][n]
                    if a is not None and b is not None:
                        paired_cpu += [y - x for x, y in zip(a[1], b[1], strict=True)]
            if "tcp" in media and "tcp-encrypted" in media:
                for n in STAGES:
                    extra = medians["tcp-encrypted"][n] - medians["tcp"][n]
                    sealed.append(extra / (n + 1))
                    a, b = used_by["tcp"][n], used_by["tcp-encrypted"][n]
                    if a is not None and b is not None:
                        sealed_cpu += [y - x for x, y in zip(a[1], b[1], strict=True)]
        load = (load_before, os.getloadavg())
        compute = {n: worker_us(model, n, args.tokens) for n in STAGES}
        hidden = _hidden(model)
    reports = {m: medium_report(m, intervals[m], cpu[m], compute, slopes[m]) for m in media}
    record = OBJECT_HEADER_BYTES + 4 * hidden  # a decode step's activation record (f32)
    seals = {
        name: {
            "seals_us": seal_us(protection, record),
            "bare_hop_us": {
                "receiver_busy": raw_hop_us(BARE[name], 0),
                "receiver_idle_2ms": raw_hop_us(BARE[name], 2000),
            },
        }
        for name, protection in PROTECTIONS.items()
    }
    report: dict[str, Any] = {
        "model": args.model or "random llama, 4 blocks, hidden 256, ffn 512",
        "tokens": args.tokens,
        "repeat": args.repeat,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_before_after": load,
        "media": reports,
        "target_shm_us": 200,
        "target_tcp_minus_shm_us": 100,
        "record_bytes": record,
        "tcp_protection": seals,
    }
    if sealed:
        report["encrypted_minus_authenticated_per_hop_us"] = statistics.median(sealed)
        report["encrypted_minus_authenticated_per_hop_each_us"] = sealed
        # Each stage owns one end of two hops: its extra CPU is a hop's worth of ends.
        report["encrypted_minus_authenticated_stage_cpu_per_token_us"] = (
            statistics.median(sealed_cpu) if sealed_cpu else None
        )
    if paired:
        # The same split over both media, back to back: the worker's share cancels.
        report["tcp_minus_shm_per_hop_us"] = statistics.median(paired)
        report["tcp_minus_shm_per_hop_each_us"] = paired
        # Each stage owns one end of two hops: its extra CPU is a hop's worth of ends.
        report["tcp_minus_shm_stage_cpu_per_token_us"] = (
            statistics.median(paired_cpu) if paired_cpu else None
        )
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    print(
        f"model: {report['model']}; {args.tokens} tokens, {args.repeat} rounds; "
        f"{report['cpus']} CPUs; load average {load[0][0]:.1f} before, {load[1][0]:.1f} after"
    )
    for medium, r in reports.items():
        _print_medium(medium, r, compute)
    if "shm" in reports:
        shm, rounds = reports["shm"]["overhead_per_hop_us"], reports["shm"]["round_slopes_us"]
        print(
            f"shared-memory hop: {shm:.1f} us per decoded token; target < 200: "
            f"{_verdict(shm < 200, rounds)}"
        )
    if paired:
        extra = report["tcp_minus_shm_per_hop_us"]
        extra_cpu = report["tcp_minus_shm_stage_cpu_per_token_us"]
        print(
            f"TCP hop beyond the shared-memory hop, same split back to back: {extra:+.1f} us "
            f"per decoded token (each: {', '.join(f'{x:.0f}' for x in paired)}); target "
            f"<= +100: {_verdict(extra <= 100, paired)}"
        )
        if extra_cpu is not None:
            print(f"a stage's CPU per decoded token, TCP beyond shared memory: {extra_cpu:+.1f} us")
    _print_protection(report, reports, sealed)
    return 0


def _print_protection(
    report: dict[str, Any], reports: dict[str, dict[str, Any]], sealed: list[float]
) -> None:
    """The per-hop cost of plain, authenticated and encrypted TCP frames, side by side."""
    seals = report["tcp_protection"]
    print(f"-- TCP frames per hop: plain / authenticated / encrypted ({report['record_bytes']} "
          "byte decode record)")  # fmt: skip
    names = ("plain", "authenticated", "encrypted")
    row = " / ".join(f"{seals[n]['seals_us']:.1f}" for n in names)
    print(f"seals of one hop in one process (record and credit, sealed and opened): {row} us")
    for idle, label in (("receiver_busy", "the receiver just ran"),
                        ("receiver_idle_2ms", "it slept 2 ms")):  # fmt: skip
        row = " / ".join(f"{seals[n]['bare_hop_us'][idle]:.1f}" for n in names)
        print(f"bare TCP ring hop between two processes, {label}: {row} us")
    slopes = [reports[m]["overhead_per_hop_us"] if m in reports else None
              for m in ("tcp", "tcp-encrypted")]  # fmt: skip
    text = " / ".join("-" if x is None else f"{x:.1f}" for x in (None, *slopes))
    print(f"whole runs, overhead per hop per token (slope): {text} us (plain: not a runtime edge)")
    if sealed:
        each = ", ".join(f"{x:.0f}" for x in sealed)
        print(
            f"encrypted beyond authenticated, same split back to back: "
            f"{report['encrypted_minus_authenticated_per_hop_us']:+.1f} us per hop (each: {each}; "
            f"{_verdict(True, sealed).replace('met', 'resolved')})"
        )
        cpu = report["encrypted_minus_authenticated_stage_cpu_per_token_us"]
        if cpu is not None:
            print(f"a stage's CPU per decoded token, encrypted beyond authenticated: {cpu:+.1f} us")


def _hidden(model: str) -> int:
    """The model's hidden width (for the size of a decode step's record)."""
    plan, _ = plan_for(
        model, stages=1, prompt_len=1, max_tokens=1, sampling=SamplingConfig(),
        return_logits=False,
    )  # fmt: skip
    return plan.model.hidden_dim


def _verdict(met: bool, samples: list[float]) -> str:
    """``met`` / ``MISSED``, unless the samples disagree so much (a machine busy with
    other work) that no verdict holds: half their spread above their median's size."""
    spread = float(np.percentile(samples, 90) - np.percentile(samples, 10))
    if len(samples) > 1 and spread > 2 * abs(statistics.median(samples)):
        return f"not measurable here (the samples spread over {spread:.0f} us)"
    return "met" if met else "MISSED"


def _print_medium(
    medium: str, r: dict[str, Any], compute: dict[int, tuple[float, list[float]]]
) -> None:
    print(f"-- {medium} edges")
    print(
        f"{'stages':>6} {'hops':>4} {'us/token':>9} {'p10':>8} {'p90':>8} "
        f"{'worker us':>10} {'beyond worker, per hop':>23}"
    )
    for row in r["rows"]:
        print(
            f"{row['stages']:>6} {row['hops']:>4} {row['median_us']:>9.1f} "
            f"{row['p10_us']:>8.1f} {row['p90_us']:>8.1f} {row['worker_us']:>10.1f} "
            f"{row['beyond_worker_per_hop_us']:>23.1f}"
        )
    rounds = ", ".join(f"{x:.0f}" for x in r["round_slopes_us"])
    print(
        f"overhead per hop per token (slope over 1, 2, 4 stages, medians): "
        f"{r['overhead_per_hop_us']:.1f} us (each round's: {rounds})"
    )
    for row, n in zip(r["rows"], STAGES, strict=True):
        if row["cpu_stage_us"] is not None:
            stages = ", ".join(
                f"{u:.0f} ({alone:.0f})"
                for u, alone in zip(row["cpu_stage_us"], compute[n][1], strict=True)
            )
            print(
                f"CPU per decoded token, {n} stage(s): orchestrator "
                f"{row['cpu_orchestrator_us']:.0f} us; stages {stages} us "
                "(in brackets: the stage's worker step alone, in this process)"
            )
    bare = r["bare_hop_us"]
    print(
        f"bare {medium} ring hop between two processes: {bare['receiver_busy']:.1f} us when "
        f"the receiver just ran, {bare['receiver_idle_2ms']:.1f} us when it slept 2 ms"
    )


if __name__ == "__main__":
    sys.exit(main())
