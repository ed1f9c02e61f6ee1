"""Slice transfer between hosts: how fast a slice travels against a raw TCP copy of
the same bytes on the same link, what each host receives against its slice, and the
time to first token on a cold host against a warm cache.

    sudo python benchmarks/slice_transfer.py [--model smollm2-135m] [--rounds 5] [--json]
        [--rate 1gbit] [--encrypt [--sealed-chunks 1,2,4]] [--link-only]

The hosts are network and mount namespaces of this machine joined by a bridge, with a
Ray node in each (``tests/support/netns_hosts.py``); each host's ``/tmp`` (where its
slice cache lives, ``GGUF_PIPELINE_CACHE``) is its own memory-backed file system. The
model lies outside ``/tmp``, on host 1 only: an empty file system is mounted over its
folder on hosts 2 and 3.

1. **Link speed** (interleaved rounds, medians): host 1 serves the whole model as one
   stage's slice (``runtime_cupy.slices.server.SliceServer``) and, on another port, the
   very same bytes (the slice's header and tensors, from the same file) as a raw
   TCP copy; host 2 fetches the slice into an empty cache (handshake, SHA-256 of every
   tensor, space reserved, fsync, renamed into place) or receives the raw copy into a
   file on the same file system (then fsync). MB/s = bytes read off the socket over the
   time from connecting to the file being durable; target: the slice at least 80% of
   the raw copy. With ``--encrypt``, the same slice also travels encrypted (as with
   ``--encrypt-edges``: sealed AES-256-GCM chunks), once per chunk size of
   ``--sealed-chunks`` (MiB; each size its own server process), in the same
   interleaved rounds: what encryption costs, and which chunk size to send.
2. **Bytes per host**: a 3-stage run with the model hidden on hosts 2 and 3; for each,
   the bytes sent against its slice's tensors plus the header (and the whole file).
3. **Time to first token**, a 3-stage run from the command to its first token with the
   model hidden on hosts 2 and 3: cold (their caches emptied before the run) against
   warm (the same run again), interleaved rounds, medians.

``--link-only`` measures 1. alone (no Ray nodes, no runs: a minute or two).
``--loopback`` (no root) measures the byte path alone instead: ``Link.send_bytes`` on
one thread to ``Link.recv_bytes_into`` on another over loopback TCP in this process
(no hashing, no disk), raw against sealed in chunks of each ``--sealed-chunks`` size,
interleaved rounds, medians: what the seal and the chunk size cost where nothing else
does.

Needs root (namespaces); without it, says so and exits 0. The machine's other work
falls on both cases of each comparison alike (they alternate); the script prints the
load average and each case's spread.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
CACHE = "/tmp/gpp-bench-slices"  # each host's own /tmp
CHUNK = 8 << 20


# -- the processes on the hosts ---------------------------------------------------------


def slice_of(path: str, digests: Any, parts: Any) -> tuple[Any, tuple[str, ...], bytes]:
    """What the slice server sends a stage holding ``parts`` of the model at ``path``
    (offered with ``digests``, a ``DigestStore``): the model's header, the slice's
    tensor names and the slice's GGUF header."""
    from runplan.gguf_files import model_id_for
    from runplan.gguf_header import GgufHeader
    from runplan.shard_file import shard_header
    from runplan.shards import slice_tensor_names

    header = GgufHeader.read(path)
    content = digests.content(header)  # the server's, already keyed when offered
    names = slice_tensor_names(header.tensors, parts)
    model_id = header.model_id or model_id_for(path)
    head = shard_header(header, names, parts, content.key, content.tensor_sha256, model_id)
    return header, names, head


def serve(args: argparse.Namespace) -> int:
    """Host 1: the slice server and a raw sender of the same bytes, until stdin closes."""
    from runplan import GgufSource
    from runplan.gguf_header import GgufHeader
    from runplan.shards import SliceParts
    from runtime_cupy.process.keys import new_secret, slice_key
    from runtime_cupy.slices import protocol
    from runtime_cupy.slices.cache import SliceCache
    from runtime_cupy.slices.digests import DigestStore
    from runtime_cupy.slices.server import SliceServer

    if args.sealed_chunk:  # the chunk size this process's server seals the bytes in
        protocol.SEALED_CHUNK = int(args.sealed_chunk)
    secret = new_secret()
    digests = DigestStore(SliceCache().digests)
    server = SliceServer(args.bind, digests)
    source = GgufSource((args.model,))
    key = server.offer(source)
    server.expect(1, "bench", slice_key(secret, "bench"))  # as without --encrypt-edges
    server.expect(2, "bench-encrypted", slice_key(secret, "bench-encrypted"), encrypt=True)
    whole = GgufHeader.read(args.model)
    n_layers = whole.integer(f"{whole.string('general.architecture')}.block_count")
    parts = SliceParts(0, n_layers, True, True)
    header, names, head = slice_of(args.model, digests, parts)
    raw = socket.socket()
    raw.bind((args.bind, 0))
    raw.listen(4)

    def send_raw() -> None:
        while True:
            try:
                conn, _ = raw.accept()
            except OSError:
                return
            with conn:
                conn.sendall(head)
                for name in names:
                    view = header.tensor_bytes(name).data
                    for start in range(0, len(view), CHUNK):
                        conn.sendall(view[start : start + CHUNK])

    import threading

    threading.Thread(target=send_raw, daemon=True).start()
    total = len(head) + sum(header.tensors[n].n_bytes for n in names)
    doc = {
        "address": server.address,
        "raw_address": f"{args.bind}:{raw.getsockname()[1]}",
        "key": key,
        "secret": secret.hex(),
        "parts": [parts.layer_start, parts.layer_end_exclusive],
        "bytes": total,
    }
    print(json.dumps(doc), flush=True)
    sys.stdin.read()
    server.close()
    raw.close()
    return 0


def fetch(args: argparse.Namespace) -> int:
    """Host 2: one slice fetch into an empty cache, timed."""
    from runplan import GgufSource
    from runplan.shards import SliceParts
    from runtime_cupy.process.keys import slice_key
    from runtime_cupy.slices.cache import SliceCache
    from runtime_cupy.slices.fetch import SliceFetcher, SliceOrigin

    secret = bytes.fromhex(sys.stdin.readline().strip())
    cache = SliceCache(Path(args.cache), limit=None)
    stage, node = (2, "bench-encrypted") if args.encrypt else (1, "bench")
    origin = SliceOrigin(args.fetch, args.key)
    key = slice_key(secret, node)
    fetcher = SliceFetcher(origin, stage, key, cache, encrypt=args.encrypt)
    start, end = (int(x) for x in args.parts.split(","))
    began = time.monotonic()
    fetcher.resolve(GgufSource((args.model,)), SliceParts(start, end, True, True))
    seconds = time.monotonic() - began
    last = fetcher.last
    doc = {"seconds": seconds, "bytes": last["socket_bytes"], "outcome": last["outcome"]}
    doc.update({k: last[k] for k in ("receive_s", "hash_wait_s", "sync_s") if k in last})
    print(json.dumps(doc), flush=True)
    shutil.rmtree(args.cache, ignore_errors=True)
    return 0


def receive_raw(args: argparse.Namespace) -> int:
    """Host 2: the raw copy into a file, timed to the file being durable."""
    host, _, port = args.raw.rpartition(":")
    out = Path(args.cache) / "raw.bin"
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    began = time.monotonic()
    got = 0
    with socket.create_connection((host, int(port))) as sock, open(out, "wb") as f:
        while True:
            n = sock.recv_into(view)
            if n == 0:
                break
            f.write(view[:n])
            got += n
        f.flush()
        os.fsync(f.fileno())
    seconds = time.monotonic() - began
    print(json.dumps({"seconds": seconds, "bytes": got}), flush=True)
    shutil.rmtree(args.cache, ignore_errors=True)
    return 0


def one_run(args: argparse.Namespace) -> int:
    """Host 1: a 3-stage run as a driver of the cluster, timed from this process's start."""
    began = float(args.began)
    from runtime_cupy import generate
    from runtime_cupy.hosts.ray import session
    from runtime_cupy.slices.progress import figures

    session.connect(args.ray_address)
    while len({h.address for h in session.hosts()}) < 3:
        time.sleep(0.2)
    first: list[float] = []

    def on_token(_token: int) -> None:
        if not first:
            first.append(time.time())

    result = generate(
        args.model, PROMPT, stages=3, max_tokens=4, ray_address=args.ray_address,
        on_token=on_token,
    )  # fmt: skip
    doc = {
        "outcome": result.outcome,
        "fault": result.fault,
        "first_token_s": first[0] - began if first else None,
        "load_s": result.load_s,
        "layers": [[s.layer_start, s.layer_end_exclusive] for s in result.plan.stages],
        "slices": figures(result.slices),
    }
    print(json.dumps(doc), flush=True)
    return 0


def loopback(args: argparse.Namespace) -> int:
    """The byte path alone on loopback: raw, and sealed per chunk size (``--loopback``)."""
    import threading

    from runtime_cupy.edges.tcp_seal import AUTHENTICATED, ENCRYPTED
    from runtime_cupy.process.streams import keep_alive
    from runtime_cupy.slices import protocol
    from runtime_cupy.slices.protocol import Link

    listener = socket.create_server(("127.0.0.1", 0))

    total, piece = 512 << 20, CHUNK  # sent as the server does: 8 MiB at a time
    data = memoryview(bytearray(os.urandom(1 << 20)) * (piece >> 20))
    into = memoryview(bytearray(piece))
    cases = ["raw"] + [f"sealed-{float(c):g}MiB" for c in args.sealed_chunks.split(",")]
    rates: dict[str, list[float]] = {case: [] for case in cases}
    for r in range(args.rounds + 1):
        for case in cases[r % len(cases) :] + cases[: r % len(cases)]:
            protection = AUTHENTICATED if case == "raw" else ENCRYPTED
            if case != "raw":
                protocol.SEALED_CHUNK = int(float(case[7:-3]) * (1 << 20))
            a = socket.create_connection(listener.getsockname()[:2])  # TCP over loopback
            b, _ = listener.accept()
            keep_alive(a)  # no Nagle delay, as the slice's connections
            keep_alive(b)
            key, nonces = bytes(32), (bytes(32), bytes(range(32)))
            sender, reader = Link(a), Link(b)
            sender.start_session(protection, protection.seals(key, *nonces, producer=False))
            reader.start_session(protection, protection.seals(key, *nonces, producer=True))

            def send(sender: Link = sender) -> None:
                for _ in range(total // piece):
                    sender.send_bytes(data)

            began = time.perf_counter()
            thread = threading.Thread(target=send)
            thread.start()
            for _ in range(total // piece):
                reader.recv_bytes_into(into)
            seconds = time.perf_counter() - began
            thread.join()
            sender.close()
            reader.close()
            if r > 0:
                rates[case].append(total / seconds / 1e6)
    medians = {case: statistics.median(v) for case, v in rates.items()}
    if args.json:
        spread = {c: _spread(v) for c, v in rates.items()}
        doc = {"bytes": total, "rounds": args.rounds, "mb_per_s": medians, "spread": spread}
        print(json.dumps(doc, indent=1))
        return 0
    for case, mbs in medians.items():
        print(
            f"{case:14} {mbs:6.0f} MB/s ({mbs / medians['raw']:.2f} x raw; spread "
            f"{_spread(rates[case]):.0%}, {args.rounds} rounds of {total >> 20} MiB)"
        )
    return 0


# -- the parent ---------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    env["GGUF_PIPELINE_CACHE"] = CACHE
    return env


def _json(command: list[str], stdin: str = "") -> dict[str, Any]:
    proc = subprocess.run(
        command, input=stdin, capture_output=True, text=True, env=_env(), timeout=900,
        check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{command[-4:]} failed:\n{proc.stderr[-3000:]}")
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--rate",
        default=None,
        help="shape the link into host 2 to this rate (tc tbf, e.g. 1gbit, 10gbit); "
        "default: the veth pair as it is (memory speed, so CPU-bound)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--encrypt",
        action="store_true",
        help="also measure the slice encrypted (--encrypt-edges), in the same rounds",
    )
    p.add_argument(
        "--sealed-chunks",
        default="1",
        help="with --encrypt: the sizes of the sealed chunks to measure, MiB, comma-separated "
        "(default 1, the size sent)",
    )
    p.add_argument("--link-only", action="store_true", help="the link speed only (no Ray, no runs)")
    for hidden in ("--serve", "--fetch", "--raw", "--one-run"):
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    for hidden in ("--bind", "--key", "--parts", "--cache", "--ray-address", "--began"):
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    p.add_argument("--sealed-chunk", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--loopback", action="store_true", help="the byte path alone, in this process (no root)"
    )
    args = p.parse_args()
    if args.serve:
        return serve(args)
    if args.fetch:
        return fetch(args)
    if args.raw:
        return receive_raw(args)
    if args.one_run:
        return one_run(args)
    if args.loopback:
        return loopback(args)

    from tests.support.netns_hosts import TestHosts, unavailable

    from runplan.models import resolve_model

    reason = unavailable()
    if reason is not None:
        print(f"slice_transfer: not measured: {reason}")
        return 0
    folder = Path("/var/tmp") / f"gpp-bench-{secrets.token_hex(4)}"
    folder.mkdir()
    model = str(folder / Path(resolve_model(args.model)).name)
    shutil.copy(resolve_model(args.model), model)
    me = [sys.executable, str(Path(__file__).resolve())]
    hosts = TestHosts(3)
    logs = Path(tempfile.mkdtemp(prefix="gguf-pipeline-slice-bench-"))
    load_before = os.getloadavg()[0]
    os.environ["GGUF_PIPELINE_CACHE"] = CACHE  # the Ray nodes' stages inherit it
    servers: list[subprocess.Popen[str]] = []
    chunks = [float(c) for c in args.sealed_chunks.split(",")] if args.encrypt else []
    encrypted = {f"encrypted-{c:g}MiB": c for c in chunks}  # case -> its chunks' MiB
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    try:
        hosts.up(logs, ray=not args.link_only)
        for i in (2, 3):  # the model is not on hosts 2 and 3 (an empty file system over it)
            hosts.on_host(i, f"mount -t tmpfs -o size=64k tmpfs {folder}")
        if args.rate:  # what enters host 2 leaves the bridge through its veth
            subprocess.run(
                ["tc", "qdisc", "add", "dev", hosts.veth(2), "root", "tbf", "rate", args.rate,
                 "burst", "4mb", "latency", "100ms"],
                check=True,
            )  # fmt: skip
        # 1. link speed: a server process for the plain slice and the raw copy, and one
        # per sealed chunk size
        offers: dict[str, dict[str, Any]] = {}
        for case, mib in [("slice", None), *encrypted.items()]:
            chunk = [] if mib is None else ["--sealed-chunk", str(int(mib * (1 << 20)))]
            server = subprocess.Popen(
                hosts.driver([*me[1:], "--serve", "1", "--model", model,
                              "--bind", hosts.address(1), *chunk]),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(),
            )  # fmt: skip
            servers.append(server)
            assert server.stdout is not None
            offers[case] = json.loads(server.stdout.readline())
        offer = offers["slice"]
        on2 = ["nsenter", "-t", str(hosts.anchor(2)), "-m", "-n", f"--wd={ROOT}"]
        cases = ["raw", "slice", *encrypted]
        link: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
        for r in range(args.rounds + 1):  # the first round warms up, not counted
            order = cases[r % len(cases) :] + cases[: r % len(cases)]  # each first in turn
            for case in order:
                cache = f"/tmp/gpp-bench-{case}-{r}"
                if case == "raw":
                    doc = _json([*on2, *me, "--raw", offer["raw_address"], "--cache", cache])
                else:
                    served = offers[case]
                    parts = ",".join(str(x) for x in served["parts"])
                    doc = _json(
                        [*on2, *me, "--fetch", served["address"], "--key", served["key"],
                         "--parts", parts, "--cache", cache, "--model", model,
                         *(["--encrypt"] if case in encrypted else [])],
                        served["secret"] + "\n",
                    )  # fmt: skip
                if doc.get("outcome", "received") != "received":
                    raise RuntimeError(f"the slice did not travel: {doc}")
                doc["mb_per_s"] = doc["bytes"] / doc["seconds"] / 1e6
                if r > 0:
                    link[case].append(doc)
                print(
                    f"round {r} {case:5}: {doc['bytes'] / 1e6:.1f} MB in "
                    f"{doc['seconds']:.3f} s: {doc['mb_per_s']:.0f} MB/s",
                    file=sys.stderr,
                )
        for server in servers:
            assert server.stdin is not None
            server.stdin.close()
            server.wait(30)
        servers = []
        # 2. and 3.: runs with the model hidden on hosts 2 and 3
        for r in range(0 if args.link_only else args.rounds):
            for case in ("cold", "warm"):
                if case == "cold":
                    for i in (2, 3):
                        hosts.on_host(i, f"rm -rf {CACHE}/slices {CACHE}/digests")
                command = hosts.driver(
                    [*me[1:], "--one-run", "1", "--model", model,
                     "--ray-address", hosts.head_address, "--began", str(time.time())]
                )  # fmt: skip
                doc = _json(command)
                if doc["outcome"] != "completed":
                    raise RuntimeError(f"run {doc['outcome']}: {doc['fault']}")
                runs[case].append(doc)
                print(
                    f"round {r + 1} {case}: first token {doc['first_token_s']:.2f} s after "
                    f"the command (stages ready after {doc['load_s']:.2f} s)",
                    file=sys.stderr,
                )
    finally:
        for server in servers:
            server.kill()
        hosts.down()
        shutil.rmtree(logs, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
    load_after = os.getloadavg()[0]
    figures = _link_figures(args, link, encrypted)
    if not args.link_only:
        figures.update(_run_figures(args.model, runs))
    figures["load_average_1min"] = {
        "before": load_before, "after": load_after, "cores": os.cpu_count(),
    }  # fmt: skip
    figures["per_round"] = {"link": link, "runs": runs}
    if args.json:
        print(json.dumps(figures, indent=1))
        return 0
    _print(figures)
    print(f"load average {load_before:.1f} before, {load_after:.1f} after "
          f"({os.cpu_count()} cores)")  # fmt: skip
    return 0


def _link_figures(
    args: argparse.Namespace, link: dict[str, list[dict[str, Any]]], encrypted: dict[str, float]
) -> dict[str, Any]:
    """Medians of the link rounds: each case's MB/s, the slice's against the raw copy,
    each encrypted chunk size's against the plain slice."""
    mbs = {case: statistics.median(d["mb_per_s"] for d in docs) for case, docs in link.items()}
    return {
        "model": args.model,
        "rounds": args.rounds,
        "link_rate": args.rate or "veth, unshaped",
        "slice_seconds_breakdown": {
            k: statistics.median(d[k] for d in link["slice"])
            for k in ("receive_s", "hash_wait_s", "sync_s")
        },
        "link_bytes": link["slice"][0]["bytes"],
        "raw_copy_mb_per_s": mbs["raw"],
        "slice_transfer_mb_per_s": mbs["slice"],
        "ratio": mbs["slice"] / mbs["raw"],
        "ratio_target": 0.8,
        "encrypted": {
            case: {
                "sealed_chunk_mib": mib,
                "link_bytes": link[case][0]["bytes"],
                "mb_per_s": mbs[case],
                "of_the_plain_slice": mbs[case] / mbs["slice"],
                "of_the_raw_copy": mbs[case] / mbs["raw"],
            }
            for case, mib in encrypted.items()
        },
        "spread": {case: _spread([d["mb_per_s"] for d in docs]) for case, docs in link.items()},
    }


def _run_figures(model: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Bytes per host of the first cold run, and the first token's medians."""
    from runplan.gguf_header import GgufHeader
    from runplan.models import resolve_model
    from runplan.shards import SliceParts, slice_tensor_names

    header = GgufHeader.read(resolve_model(model))
    whole = Path(resolve_model(model)).stat().st_size
    cold = runs["cold"][0]
    per_host = []
    for t in cold["slices"]:
        i = t["stage_index"]
        start, end = cold["layers"][i]
        held = SliceParts(start, end, i == 0, i == 2)
        names = slice_tensor_names(header.tensors, held)
        tensors = sum(header.tensors[n].n_bytes for n in names)
        per_host.append(
            {
                "stage_index": i,
                "host": t["host"],
                "sent_bytes": t["sent_bytes"],
                "slice_tensor_bytes": tensors,
                "header_bytes": t["header_bytes"],
                "equals_tensors_plus_header": t["sent_bytes"] == tensors + t["header_bytes"],
                "of_the_whole_file": t["sent_bytes"] / whole,
            }
        )
    return {
        "bytes_per_host": per_host,
        "first_token_s": {
            "cold": statistics.median(d["first_token_s"] for d in runs["cold"]),
            "warm_cache": statistics.median(d["first_token_s"] for d in runs["warm"]),
        },
        "spread_runs": {
            case: _spread([d["first_token_s"] for d in docs]) for case, docs in runs.items()
        },
    }


def _print(figures: dict[str, Any]) -> None:
    raw_mbs, slice_mbs = figures["raw_copy_mb_per_s"], figures["slice_transfer_mb_per_s"]
    spread = figures["spread"]
    ok = "met" if figures["ratio"] >= 0.8 else "MISSED"
    print(f"link ({figures['link_bytes'] / 1e6:.1f} MB, median of {figures['rounds']}): slice "
          f"{slice_mbs:.0f} MB/s, raw TCP copy {raw_mbs:.0f} MB/s: ratio {figures['ratio']:.2f} "
          f"(target >= 0.80: {ok}); spread raw {spread['raw']:.0%}, slice "
          f"{spread['slice']:.0%}")  # fmt: skip
    for case, e in figures["encrypted"].items():
        print(f"encrypted, chunks of {e['sealed_chunk_mib']:g} MiB ({e['link_bytes'] / 1e6:.1f} "
              f"MB on the link): {e['mb_per_s']:.0f} MB/s, {e['of_the_plain_slice']:.2f} x the "
              f"plain slice, {e['of_the_raw_copy']:.2f} x the raw copy; spread "
              f"{spread[case]:.0%}")  # fmt: skip
    breakdown = figures["slice_seconds_breakdown"]
    print(
        f"slice (medians): receiving {breakdown['receive_s']:.3f} s, then waiting for the "
        f"last hashes {breakdown['hash_wait_s']:.3f} s, then fsync {breakdown['sync_s']:.3f} s; "
        f"link: {figures['link_rate']}"
    )
    for h in figures.get("bytes_per_host", []):
        print(
            f"stage {h['stage_index']} (host {h['host']}): sent {h['sent_bytes']} bytes = "
            f"slice tensors {h['slice_tensor_bytes']} + header {h['header_bytes']}: "
            f"{h['equals_tensors_plus_header']}; {h['of_the_whole_file']:.0%} of the file"
        )
    if "first_token_s" in figures:
        first = figures["first_token_s"]
        print(f"first token after the command: cold hosts {first['cold']:.2f} s, warm cache "
              f"{first['warm_cache']:.2f} s (medians of {figures['rounds']})")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
