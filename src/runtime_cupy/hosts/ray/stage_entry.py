"""A stage process on a host of a Ray cluster, started by its supervisor
(``hosts.ray.supervisor``):

    python -m runtime_cupy.hosts.ray.stage_entry --bind-host ADDRESS --rendezvous-fd FD \
        -- STAGE ARGUMENTS

It is ``runtime_cupy.process.stage_process``'s process (the same loop, control channel on
``--control-fd``, lifeline, secret on standard input), with the media of a cluster host:
shared memory between stages of this machine, and TCP edges whose consumers listen on
``--bind-host`` (this host's address in the cluster) and find each other through Ray's
key-value store, asked through the supervisor (``--rendezvous-fd``). Nothing of Ray is
imported here."""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence

from runtime_cupy.edges.media import open_medium
from runtime_cupy.edges.port import EdgeMedium
from runtime_cupy.hosts.ray.rendezvous import SupervisorRendezvous
from runtime_cupy.process import stage_process as stage


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runtime_cupy.hosts.ray.stage_entry",
        description="A stage process on a Ray cluster's host (started by its supervisor).",
    )
    parser.add_argument("--bind-host", required=True, help="where TCP consumers listen")
    parser.add_argument("--rendezvous-fd", type=int, required=True, help="to the supervisor")
    parser.add_argument("stage_arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    rest = args.stage_arguments[1:] if args.stage_arguments[:1] == ["--"] else args.stage_arguments
    rendezvous = SupervisorRendezvous(socket.socket(fileno=args.rendezvous_fd))

    def media(name: str, encrypt: bool) -> EdgeMedium:
        return open_medium(name, rendezvous, args.bind_host, encrypt)

    return stage.main(rest, media=media)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    stage.exit_now(code)
