"""The local-process host: every stage is an OS process on this machine, started as
``python -m runtime_cupy.process.stage_process ...`` (recognisable in ``ps``).

- **Control channel**: one end of a Unix socket pair, inherited (``--control-fd``).
- **Secret**: one hex line on the stage's standard input, never on a command line.
- **Gone**: the stage's end of the channel closes when its process ends, however it
  ends (SIGKILL included); the launcher reaps it and reads its exit status. The other
  way round, the stage inherits the read end of a pipe (``--lifeline-fd``) whose write
  end only the launcher holds: it reaches end of file the moment the launcher's process
  is gone, and the stage stops on its own.
- **Devices and threads**: a CUDA stage sees its GPU as device 0
  (``CUDA_VISIBLE_DEVICES``); NumPy stages split the CPUs' BLAS threads between them.
- **Edges**: every node is on this machine, so edges use shared memory unless TCP is
  asked for; TCP consumers listen on the loopback interface and publish their port in
  a file of the edge's folder (``FileRendezvous``).
- **Cleanup**: every shared-memory segment, edge folder (FIFOs, rendezvous file) of the
  run, by name.
- **No run id on a command line**: a stage shows its run's label (``--run-label``, a
  hash of the id), since the id names the run's resources on this host (``names``).

Each stage's log goes to ``stage-<i>.log`` in ``log_dir`` (``stage_log``: a file of this
user's, never through a link), else to this process's standard error.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from runplan.cpus import usable_cpus
from runtime_core.threads import LIMIT_REACHED
from runtime_cupy.edges.media import every_medium, open_medium
from runtime_cupy.edges.port import EdgeMedium, remove_edges
from runtime_cupy.hosts.port import StageLaunch, StageProcessInfo
from runtime_cupy.hosts.stage_log import open_stage_log
from runtime_cupy.process.control_channel import ControlChannel
from runtime_cupy.process.keys import control_key
from runtime_cupy.process.names import (
    check_private,
    check_stat,
    edge_dir,
    make_edge_dir,
    no_space,
    remove_edge_dir,
    run_label,
)
from runtime_cupy.process.stage_loss import EXIT_NO_THREAD
from runtime_cupy.process.trace_folders import TraceFolder
from runtime_cupy.process.trace_folders import sweep as sweep_trace_folders
from runtime_cupy.process.tracing import Event, read_events

#: Where TCP consumers of this host listen.
LOOPBACK = "127.0.0.1"
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "its control channel closed"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode == EXIT_NO_THREAD:  # its log's last line says which, and the limit
        return f"exited with status {returncode} (it could not start a thread: {LIMIT_REACHED})"
    return f"exited with status {returncode}"


class FileRendezvous:
    """The rendezvous of one machine: ``<edge folder>/addr`` holds the address of the
    edge's consumer, written whole (a new file renamed into place) in the folder the
    consumer makes for it (``names.make_edge_dir``: never one that exists). A lookup
    reads it only from a folder and file of this user closed to everyone else
    (``names.NotPrivate`` otherwise), so no stranger on the host can point a producer at
    an address of its own. The publishing process keeps the file open until it
    withdraws it, so that the file shows as in use (``/proc/<pid>/fd``) for as long as
    its consumer listens. A file system too full to hold the file is ``names.NoSpace``,
    naming it and the room left."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], int] = {}

    def _path(self, run_id: str, edge_id: int) -> Path:
        return edge_dir(run_id, edge_id) / "addr"

    def publish(self, run_id: str, edge_id: int, address: str) -> None:
        path = self._path(run_id, edge_id)
        if (run_id, edge_id) not in self._held:
            make_edge_dir(run_id, edge_id)  # NameTaken if it exists
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".addr.")
            try:
                os.write(fd, address.encode("utf-8"))
                os.replace(tmp, path)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:  # no inode for the file, or no byte for the address
            full = no_space(exc, f"the edge's address file {path}", path.parent)
            if full is not None:
                raise full from None
            raise
        self._let_go(run_id, edge_id)
        self._held[(run_id, edge_id)] = fd

    def lookup(self, run_id: str, edge_id: int) -> str | None:
        path = self._path(run_id, edge_id)
        try:
            check_private(path.parent, "folder")
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            check_stat(os.fstat(fd), path, "file")
            return os.read(fd, 4096).decode("utf-8", "replace").strip() or None
        finally:
            os.close(fd)

    def withdraw(self, run_id: str, edge_id: int) -> None:
        self._let_go(run_id, edge_id)
        remove_edge_dir(run_id, edge_id)

    def _let_go(self, run_id: str, edge_id: int) -> None:
        fd = self._held.pop((run_id, edge_id), None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def local_medium(name: str, encrypt: bool = False) -> EdgeMedium:
    """The medium ``name`` between processes of this machine (``encrypt``: TCP frames
    encrypted too, not only authenticated)."""
    return open_medium(name, FileRendezvous(), LOOPBACK, encrypt)


def _pythonpath() -> str:
    """This process's package folders first, so stages import the same code (found as
    the import system finds them, without importing a package to read its file)."""
    dirs: list[str] = []
    for package in ("runtime_cupy", "runtime_core", "runplan"):
        spec = importlib.util.find_spec(package)
        origin = spec.origin if spec is not None else None
        folder = str(Path(origin or ".").resolve().parent.parent)
        if folder not in dirs:
            dirs.append(folder)
    rest = os.environ.get("PYTHONPATH")
    return os.pathsep.join(dirs + ([rest] if rest else []))


class LocalStageHandle:
    """A stage process of this machine."""

    def __init__(
        self,
        launch: StageLaunch,
        proc: subprocess.Popen[bytes],
        channel: ControlChannel,
        lifeline: int,
        trace_folder: TraceFolder | None,
        trace_file: Path | None,
    ) -> None:
        self.stage_index = launch.stage_index
        self.node_id = launch.node_id
        self.device = launch.device
        self.proc = proc
        self.channel = channel
        self._lifeline = lifeline
        self._trace_folder = trace_folder
        self._trace_file = trace_file

    @property
    def pid(self) -> int:
        return self.proc.pid

    def hand_secret(self, secret: bytes) -> None:
        """A new chain's secret, one hex line on the stage's standard input
        (``hosts.port.JoinsChains``); ``OSError`` once the stage is gone."""
        stdin = self.proc.stdin
        if stdin is None or stdin.closed:
            raise OSError(f"stage {self.stage_index}'s secret pipe is closed")
        stdin.write(secret.hex().encode("ascii") + b"\n")
        stdin.flush()

    def exited(self) -> bool:
        if self.proc.poll() is not None:
            return True
        # poll() says "running" while another thread holds the Popen's wait lock (the
        # chain's loop polling the same stage): ask the kernel without reaping instead.
        try:
            ended = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped meanwhile by that other thread
            return True
        return ended is not None

    def wait(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    def exit_reason(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else describe_exit(code)

    def info(self) -> StageProcessInfo:
        return StageProcessInfo(
            self.stage_index, self.node_id, self.proc.pid, self.device, self.proc.returncode
        )

    def trace_events(self) -> list[Event]:
        path = self._trace_file
        if path is None:
            return []
        events = read_events(path)
        with contextlib.suppress(OSError):
            path.unlink()
        if self.exited():  # nothing more will come: the folder goes
            self._trace_file = None
            if self._trace_folder is not None:
                self._trace_folder.remove()
        return events

    def close(self) -> None:
        self.channel.close()
        lifeline, self._lifeline = self._lifeline, -1  # closed once: idempotent
        if lifeline >= 0:
            with contextlib.suppress(OSError):
                os.close(lifeline)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


class LocalProcessHost:
    """Stage processes on this machine. ``log_dir``: each stage's log goes to
    ``stage-<i>.log`` there (default: this process's standard error); ``log_level``
    (default ``INFO`` with a log folder, else ``WARNING``)."""

    def __init__(self, *, log_dir: Path | None = None, log_level: str | None = None) -> None:
        self.log_dir = log_dir
        self.log_level = log_level or ("INFO" if log_dir is not None else "WARNING")
        self._rendezvous = FileRendezvous()

    # -- what a stage process is started with -------------------------------------------
    def arguments(
        self, launch: StageLaunch, control_fd: int, lifeline_fd: int, trace_file: Path | None
    ) -> list[str]:
        """The stage process's own arguments (``python -m
        runtime_cupy.process.stage_process --help``)."""
        args = [
            "--run-label", run_label(launch.run_id),
            "--stage-index", str(launch.stage_index),
            "--stage-count", str(launch.stage_count),
            "--node-id", launch.node_id,
            "--orchestrator-id", launch.orchestrator_id,
            "--control-fd", str(control_fd),
            "--lifeline-fd", str(lifeline_fd),
            "--worker", launch.worker,
            "--inbound", launch.inbound_medium,
            "--outbound", launch.outbound_medium,
            "--stop-ms", str(launch.stop_ms),
            "--heartbeat-ms", str(launch.heartbeat_ms),
            "--log-level", self.log_level,
        ]  # fmt: skip
        if trace_file is not None:
            args += ["--trace-file", str(trace_file)]
        if launch.warm:
            args.append("--warm")
        if launch.encrypt_edges:
            args.append("--encrypt-edges")
        if launch.slices is not None:
            args += ["--slice-server", launch.slices.address]
            args += ["--slice-source-key", launch.slices.source_key]
        return args

    def command(self, launch: StageLaunch, arguments: Sequence[str]) -> list[str]:
        """The command line of a stage process."""
        return [sys.executable, "-m", "runtime_cupy.process.stage_process", *arguments]

    def environment(
        self, launch: StageLaunch, inherited: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """The stage process's environment: ``inherited`` (this process's by default)
        with the package's path, its device, and its share of this machine's CPUs in
        the thread-count variables that ``inherited`` does not set."""
        env = dict(os.environ if inherited is None else inherited)
        env["PYTHONPATH"] = _pythonpath()
        # BLAS thread pools spin while idle: several stage processes with a pool the size
        # of the machine each starve the one stage that computes. Split the CPUs between
        # the chain's stages on this machine.
        sharing = launch.host_stages or launch.stage_count
        threads = str(max(1, usable_cpus() // max(1, sharing)))
        for name in THREAD_VARIABLES:
            env.setdefault(name, threads)
        if launch.device is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(launch.device)
        return env

    # -- the port ------------------------------------------------------------------------
    def start(self, launch: StageLaunch, secret: bytes) -> LocalStageHandle:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        life_r, life_w = os.pipe()
        trace_file = folder = None
        out = 2  # this process's standard error
        try:
            if launch.trace:  # (what a killed launcher's stages left is freed first)
                folder = TraceFolder.make()
                trace_file = folder.path / f"stage-{launch.stage_index}.json"
            else:
                sweep_trace_folders()
            args = self.arguments(launch, theirs.fileno(), life_r, trace_file)
            if self.log_dir is not None:
                out = open_stage_log(self.log_dir / f"stage-{launch.stage_index}.log")
            proc = subprocess.Popen(
                self.command(launch, args),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=out,
                pass_fds=(theirs.fileno(), life_r),
                env=self.environment(launch),
                # a process group of its own: a terminal's Ctrl-C or a `kill -- -PGID`
                # reaches the orchestrator, which stops the stages; it once reached a
                # stage still importing (a KeyboardInterrupt traceback) or one whose own
                # SIGTERM exit raced the orchestrator's cancel (a run reported faulted).
                # A stage whose orchestrator is gone still ends: its life pipe closes.
                process_group=0,
            )
        except BaseException:
            ours.close()
            os.close(life_w)
            if folder is not None:  # no stage writes its trace there
                folder.remove()
            raise
        finally:
            theirs.close()
            os.close(life_r)
            if out != 2:
                os.close(out)
        assert proc.stdin is not None
        key = control_key(secret, launch.node_id)
        channel = ControlChannel(ours, key, launch.orchestrator_id, launch.node_id)
        handle = LocalStageHandle(launch, proc, channel, life_w, folder, trace_file)
        # The pipe stays open: a new chain's secret goes the same way (JoinsChains).
        with contextlib.suppress(OSError):  # a stage that died at once shows at its socket
            handle.hand_secret(secret)
        return handle

    def same_host(self, node_a: str, node_b: str) -> bool:
        return True

    def medium(self, name: str, encrypt: bool = False) -> EdgeMedium:
        return local_medium(name, encrypt)

    def rendezvous(self) -> FileRendezvous:
        return self._rendezvous

    def cleanup(self, run_id: str, edge_ids: Sequence[int]) -> None:
        remove_edges(every_medium(self._rendezvous), run_id, edge_ids)
