"""A stage process on a test host without Ray (``tests/support/netns_hosts.py``,
``NetnsStageHost``): ``runtime_cupy.process.stage_process``'s process, its TCP consumers
listening on the host's address and finding each other through a rendezvous the test
serves on a Unix socket (a path outside the hosts' private ``/tmp``), asked as a stage on a Ray host
asks its supervisor (``hosts.ray.rendezvous.SupervisorRendezvous``).

    python -m tests.support.netns_stage --bind-host ADDRESS --rendezvous PATH \
        [--attach-delay SECONDS] [--fault FAULT ...] -- STAGE ARGS

``--attach-delay``: each try to attach the outbound edge takes that long more (a
producer on a busy host, slow to answer its consumer's handshake). ``--fault``: a fault
the stage's worker plays (``faulty_stage.Fault``: a slow step, a failing one).
"""

from __future__ import annotations

import argparse
import socket
import sys

from runtime_cupy.edges.media import open_medium
from runtime_cupy.edges.port import EdgeMedium
from runtime_cupy.hosts.ray.rendezvous import SupervisorRendezvous
from runtime_cupy.process import stage_process as stage
from runtime_cupy.workers import make_worker
from tests.support.faulty_stage import Fault, FaultyWorker, SlowAttach


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bind-host", required=True)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--attach-delay", type=float, default=0.0)
    parser.add_argument("--fault", type=Fault.parse, action="append", default=[])
    parser.add_argument("stage_arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    rest = args.stage_arguments[1:] if args.stage_arguments[:1] == ["--"] else args.stage_arguments
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.rendezvous)
    rendezvous = SupervisorRendezvous(sock)

    def media(name: str, encrypt: bool) -> EdgeMedium:
        medium = open_medium(name, rendezvous, args.bind_host, encrypt)
        slow = args.attach_delay if name == "tcp" else 0.0
        return SlowAttach(medium, slow) if slow else medium

    if not args.fault:
        return stage.main(rest, media=media)
    faults = args.fault
    return stage.main(
        rest, lambda name, trace: FaultyWorker(make_worker(name, trace), faults), media=media
    )


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    stage.exit_now(code)
