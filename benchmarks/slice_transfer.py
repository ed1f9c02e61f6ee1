"""Slice transfer between hosts: how fast a slice travels against a raw TCP copy of
the same bytes on the same link, what each host receives against its slice, and the
time to first token on a cold host against a warm cache.

    sudo python benchmarks/slice_transfer.py [--model smollm2-135m] [--rounds 5] [--json]

The hosts are network and mount namespaces of this machine joined by a bridge, with a
Ray node in each (``tests/support/netns_hosts.py``); each host's ``/tmp`` (where its
slice cache lives, ``GGUF_PIPELINE_CACHE``) is its own memory-backed file system. The
model lies outside ``/tmp``, on host 1 only: an empty file system is mounted over its
folder on hosts 2 and 3.

1. **Link speed** (interleaved rounds, medians): host 1 serves the whole model as one
   stage's slice (``runtime_cupy.slices.server.SliceServer``) and, on another port, the
   very same bytes (the slice's header and tensors, from the same memory map) as a raw
   TCP copy; host 2 fetches the slice into an empty cache (handshake, SHA-256 of every
   tensor, space reserved, fsync, renamed into place) or receives the raw copy into a
   file on the same file system (then fsync). MB/s = bytes read off the socket over the
   time from connecting to the file being durable; target: the slice at least 80% of
   the raw copy.
2. **Bytes per host**: a 3-stage run with the model hidden on hosts 2 and 3; for each,
   the bytes sent against its slice's tensors plus the header (and the whole file).
3. **Time to first token**, a 3-stage run from the command to its first token with the
   model hidden on hosts 2 and 3: cold (their caches emptied before the run) against
   warm (the same run again), interleaved rounds, medians.

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


def serve(args: argparse.Namespace) -> int:
    """Host 1: the slice server and a raw sender of the same bytes, until stdin closes."""
    from runplan import GgufSource
    from runplan.gguf_header import GgufHeader
    from runplan.shards import SliceParts
    from runtime_cupy.process.keys import new_secret, slice_key
    from runtime_cupy.slices.cache import SliceCache
    from runtime_cupy.slices.digests import DigestStore
    from runtime_cupy.slices.server import SliceServer

    secret = new_secret()
    server = SliceServer(args.bind, DigestStore(SliceCache().digests))
    source = GgufSource((args.model,))
    key = server.offer(source)
    server.expect(1, "bench", slice_key(secret, "bench"))
    whole = GgufHeader.read(args.model)
    n_layers = whole.integer(f"{whole.string('general.architecture')}.block_count")
    parts = SliceParts(0, n_layers, True, True)
    header, names, head = server.slice_of(source, parts)
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
    fetcher = SliceFetcher(SliceOrigin(args.fetch, args.key), 1, slice_key(secret, "bench"), cache)
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
    for hidden in ("--serve", "--fetch", "--raw", "--one-run"):
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    for hidden in ("--bind", "--key", "--parts", "--cache", "--ray-address", "--began"):
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args)
    if args.fetch:
        return fetch(args)
    if args.raw:
        return receive_raw(args)
    if args.one_run:
        return one_run(args)

    from tests.support.netns_hosts import TestHosts, unavailable

    from runplan.gguf_header import GgufHeader
    from runplan.models import resolve_model
    from runplan.shards import SliceParts, slice_tensor_names

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
    server: subprocess.Popen[str] | None = None
    try:
        hosts.up(logs)
        for i in (2, 3):  # the model is not on hosts 2 and 3 (an empty file system over it)
            hosts.on_host(i, f"mount -t tmpfs -o size=64k tmpfs {folder}")
        if args.rate:  # what enters host 2 leaves the bridge through its veth
            subprocess.run(
                ["tc", "qdisc", "add", "dev", hosts.veth(2), "root", "tbf", "rate", args.rate,
                 "burst", "4mb", "latency", "100ms"],
                check=True,
            )  # fmt: skip
        # 1. link speed
        server = subprocess.Popen(
            hosts.driver([*me[1:], "--serve", "1", "--model", model,
                          "--bind", hosts.address(1)]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(),
        )  # fmt: skip
        assert server.stdout is not None
        offer = json.loads(server.stdout.readline())
        on2 = ["nsenter", "-t", str(hosts.anchor(2)), "-m", "-n", f"--wd={ROOT}"]
        link: dict[str, list[dict[str, Any]]] = {"raw": [], "slice": []}
        for r in range(args.rounds + 1):  # the first round warms up, not counted
            order = ("raw", "slice") if r % 2 == 0 else ("slice", "raw")
            for case in order:
                cache = f"/tmp/gpp-bench-{case}-{r}"
                if case == "raw":
                    doc = _json([*on2, *me, "--raw", offer["raw_address"], "--cache", cache])
                else:
                    parts = ",".join(str(x) for x in offer["parts"])
                    doc = _json(
                        [*on2, *me, "--fetch", offer["address"], "--key", offer["key"],
                         "--parts", parts, "--cache", cache, "--model", model],
                        offer["secret"] + "\n",
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
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)
        server = None
        # 2. and 3.: runs with the model hidden on hosts 2 and 3
        runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
        for r in range(args.rounds):
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
        if server is not None:
            server.kill()
        hosts.down()
        shutil.rmtree(logs, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
    load_after = os.getloadavg()[0]

    header = GgufHeader.read(resolve_model(args.model))
    whole = Path(resolve_model(args.model)).stat().st_size
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
    raw_mbs = statistics.median(d["mb_per_s"] for d in link["raw"])
    slice_mbs = statistics.median(d["mb_per_s"] for d in link["slice"])
    ttft_cold = statistics.median(d["first_token_s"] for d in runs["cold"])
    ttft_warm = statistics.median(d["first_token_s"] for d in runs["warm"])
    breakdown = {
        k: statistics.median(d[k] for d in link["slice"])
        for k in ("receive_s", "hash_wait_s", "sync_s")
    }
    figures = {
        "model": Path(model).name,
        "rounds": args.rounds,
        "link_rate": args.rate or "veth, unshaped",
        "slice_seconds_breakdown": breakdown,
        "link_bytes": link["slice"][0]["bytes"],
        "raw_copy_mb_per_s": raw_mbs,
        "slice_transfer_mb_per_s": slice_mbs,
        "ratio": slice_mbs / raw_mbs,
        "ratio_target": 0.8,
        "spread": {
            "raw": _spread([d["mb_per_s"] for d in link["raw"]]),
            "slice": _spread([d["mb_per_s"] for d in link["slice"]]),
            "cold": _spread([d["first_token_s"] for d in runs["cold"]]),
            "warm": _spread([d["first_token_s"] for d in runs["warm"]]),
        },
        "bytes_per_host": per_host,
        "first_token_s": {"cold": ttft_cold, "warm_cache": ttft_warm},
        "load_average_1min": {"before": load_before, "after": load_after, "cores": os.cpu_count()},
        "per_round": {"link": link, "runs": runs},
    }
    if args.json:
        print(json.dumps(figures, indent=1))
        return 0
    ok = "met" if figures["ratio"] >= 0.8 else "MISSED"
    print(f"link ({figures['link_bytes'] / 1e6:.1f} MB, median of {args.rounds}): slice "
          f"{slice_mbs:.0f} MB/s, raw TCP copy {raw_mbs:.0f} MB/s: ratio {figures['ratio']:.2f} "
          f"(target >= 0.80: {ok}); spread raw {figures['spread']['raw']:.0%}, slice "
          f"{figures['spread']['slice']:.0%}")  # fmt: skip
    print(
        f"slice (medians): receiving {breakdown['receive_s']:.3f} s, then waiting for the "
        f"last hashes {breakdown['hash_wait_s']:.3f} s, then fsync {breakdown['sync_s']:.3f} s; "
        f"link: {figures['link_rate']}"
    )
    for h in per_host:
        print(
            f"stage {h['stage_index']} (host {h['host']}): sent {h['sent_bytes']} bytes = "
            f"slice tensors {h['slice_tensor_bytes']} + header {h['header_bytes']}: "
            f"{h['equals_tensors_plus_header']}; {h['of_the_whole_file']:.0%} of the file"
        )
    print(f"first token after the command: cold hosts {ttft_cold:.2f} s, warm cache "
          f"{ttft_warm:.2f} s (medians of {args.rounds})")  # fmt: skip
    print(f"load average {load_before:.1f} before, {load_after:.1f} after "
          f"({os.cpu_count()} cores)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
