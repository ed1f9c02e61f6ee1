"""A stage of a run on a Ray cluster, as the Ray host hands it to the launcher: a
``RayStageHandle`` (the stage process on its host, through its supervisor: ``exited``
and ``wait`` look at the result of the supervisor's ``supervise`` call, nothing else;
``exit_reason`` asks Ray once more, briefly, when it is not in) or an
``UnstartedStage`` (a stage that could not be started, gone from the start, saying
why)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from typing import Any

from runtime_cupy.hosts.local import describe_exit
from runtime_cupy.hosts.port import StageLaunch, StageProcessInfo
from runtime_cupy.hosts.ray.cluster import StageNode
from runtime_cupy.process.control_channel import ControlChannel
from runtime_cupy.process.keys import control_key
from runtime_cupy.process.tracing import Event

#: How long ``exit_reason`` waits for a supervisor's answer.
PROBE_S = 2.0


def _short(exc: BaseException) -> str:
    """The first line of a Ray error, without its traceback."""
    text = str(exc).strip().splitlines()
    first = next((line.strip() for line in text if line.strip()), type(exc).__name__)
    return first if len(first) <= 200 else first[:197] + "..."


class RayStageHandle:
    """A stage process on a cluster host, through its supervisor."""

    def __init__(
        self,
        launch: StageLaunch,
        node: StageNode,
        actor: Any,
        pid: int,
        done: Any,
        channel: ControlChannel,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.stage_index = launch.stage_index
        self.node_id = launch.node_id
        self.node = node
        self.channel = channel
        self._actor = actor
        self._pid = pid
        self._done = done  # the ObjectRef of supervise()
        self._result: int | BaseException | None = None
        self._release = release  # a warm stage's: ends its supervisor once it is gone

    @property
    def host(self) -> str:
        return self.node.host.label

    def _look(self, timeout_s: float) -> bool:
        import ray

        if self._result is not None:
            return True
        ready, _ = ray.wait([self._done], timeout=max(0.0, timeout_s))
        if not ready:
            return False
        try:
            self._result = int(ray.get(self._done))
        except Exception as exc:  # the actor or its node died
            self._result = exc
        return True

    def exited(self) -> bool:
        return self._look(0.0)

    def wait(self, timeout_s: float) -> bool:
        return self._look(timeout_s)

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self._actor.kill_stage.remote()

    def hand_secret(self, secret: bytes) -> None:
        """A new chain's secret, through the stage's supervisor (Ray's call, as the first
        went) to the stage's standard input (``hosts.port.JoinsChains``); ``OSError``
        when the supervisor cannot take it."""
        import ray

        try:
            ray.get(self._actor.hand_secret.remote(secret), timeout=PROBE_S)
        except Exception as exc:
            raise OSError(f"stage {self.stage_index}'s supervisor on host {self.host} "
                          f"took no secret: {_short(exc)}") from exc  # fmt: skip

    def exit_reason(self) -> str | None:
        if not self._look(0.0):
            return self._probe()
        result = self._result
        if isinstance(result, int):
            return describe_exit(result)
        assert result is not None
        return f"its supervisor on host {self.host} is gone ({_short(result)})"

    def _probe(self) -> str:
        """Why a stage whose channel is gone has not been reported ended (yet)."""
        import ray

        try:
            code = ray.get(self._actor.status.remote(), timeout=PROBE_S)
        except ray.exceptions.GetTimeoutError:
            return f"host {self.host} does not answer (its supervisor silent for {PROBE_S:.0f} s)"
        except Exception as exc:
            return f"its supervisor on host {self.host} is gone ({_short(exc)})"
        if code is None:
            return "its control channel closed while its process runs"
        self._look(PROBE_S)
        return describe_exit(int(code))

    def info(self) -> StageProcessInfo:
        code = self._result if isinstance(self._result, int) else None
        return StageProcessInfo(
            self.stage_index, self.node_id, self._pid, self.node.device, code, host=self.host
        )

    def trace_events(self) -> list[Event]:
        return []  # a stage on another host keeps its trace there (not collected yet)

    def close(self) -> None:
        self.channel.close()
        release, self._release = self._release, None
        if release is not None:
            release()


class UnstartedStage:
    """A stage that could not be started: gone from the start, saying why (its channel
    is at end of file at once, so the launcher ends the run the way it does for a stage
    that died)."""

    def __init__(self, launch: StageLaunch, node: StageNode | None, why: str) -> None:
        self.stage_index = launch.stage_index
        self.node_id = launch.node_id
        self.host = node.host.label if node is not None else None
        self.device = node.device if node is not None else None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.close()
        self.channel = ControlChannel(
            ours, control_key(b"\0" * 32, launch.node_id), launch.orchestrator_id, launch.node_id
        )
        self._why = why

    def exited(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> bool:
        return True

    def kill(self) -> None:
        pass

    def exit_reason(self) -> str:
        return self._why

    def info(self) -> StageProcessInfo:
        return StageProcessInfo(self.stage_index, self.node_id, 0, self.device, None, self.host)

    def trace_events(self) -> list[Event]:
        return []

    def close(self) -> None:
        self.channel.close()
