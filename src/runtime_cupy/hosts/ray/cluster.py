"""The node pool of a Ray cluster: which hosts are alive, what memory and GPUs Ray says
they have, and which of them the stages of a run go to.

Every live Ray node is a *Ray host* (a raylet: in a real cluster one machine; in a
one-machine test cluster several share one machine). Its label is its address
(``NodeManagerAddress``, ``10.77.0.2``), or the address and an index where several
live Ray nodes share one (``127.0.0.1#1``), so that nodes of one machine stay
distinct. A stage's node id is the label and a device: ``10.77.0.2/cpu0`` (the first
stage on that host's CPUs), ``10.77.0.2/gpu1`` (its GPU 1).

Memory is shared like the devices of the planner: the CPU nodes of one machine name the
machine (its address) as their device, so that every stage on it counts against the
memory Ray reports for it (the ``memory`` resource); a GPU node names its GPU, with the
GPU's memory as ``nvidia-smi`` reports it on that host.

Stages go to hosts in the order of their labels, as evenly as the counts allow, and
consecutive stages stay together (stage ``i`` of ``n`` on host ``i * h // n``), so that
the edges between stages of one host keep shared memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attrs import frozen

from runplan import NodeSpec

#: The orchestrator's node id in plans against a cluster.
ORCHESTRATOR = "orchestrator"


class ClusterError(RuntimeError):
    """The cluster cannot be reached, or has no host for what the run asks."""


@frozen
class RayHostInfo:
    """One live Ray node, as Ray reports it."""

    ray_node_id: str  # Ray's NodeID (hex)
    address: str  # NodeManagerAddress: the machine
    label: str  # the address, or address#index where several Ray nodes share it
    memory_bytes: int  # Ray's "memory" resource
    gpus: int  # Ray's "GPU" resource
    is_head: bool
    manager_port: int = 0  # NodeManagerPort: its raylet's (0: not known)


@frozen
class StageNode:
    """Where one stage of a run goes: its node id in the plan, its Ray host and its GPU
    on that host (``None``: the CPU)."""

    node_id: str
    host: RayHostInfo
    device: int | None
    spec: NodeSpec


#: ``answers(address, port)``: whether a raylet answers there now (``raylet_answers``).
Answers = Callable[[str, int], bool]


def live_hosts(
    nodes: Sequence[Mapping[str, Any]], answers: Answers | None = None
) -> tuple[RayHostInfo, ...]:
    """The live Ray nodes of ``ray.nodes()`` as hosts, in label order; with ``answers``,
    a node Ray still calls alive whose raylet does not answer is taken for dead (Ray
    says so only after its health checks fail, some 15 s or more: a stage re-placed there
    meanwhile waited for its start to time out). Several nodes of
    one machine are numbered over every node Ray reports there, the dead ones too (it
    keeps them), a dead node before a live one on the same port (a raylet started again
    on its port): a label a stage was placed on never comes to name another node when
    one of its machine dies (the live nodes numbered alone took their dead neighbour's
    label, and recovery offered the dead node in its place). A node that joins with a
    lower port moves the labels above it (``RayHost.live_nodes`` takes that into
    account)."""
    by_address: dict[str, list[Mapping[str, Any]]] = {}
    for reported in nodes:
        node = reported
        if node.get("Alive") and answers is not None:
            there = (str(node["NodeManagerAddress"]), int(node.get("NodeManagerPort", 0)))
            node = {**node, "Alive": answers(*there)}
        by_address.setdefault(str(node["NodeManagerAddress"]), []).append(node)
    hosts = []
    for address, group in by_address.items():
        if not any(n.get("Alive") for n in group):
            continue
        # The head first, then by the raylet's port: stable for the cluster's life.
        group.sort(
            key=lambda n: (
                not _is_head(n),
                int(n.get("NodeManagerPort", 0)),
                bool(n.get("Alive")),
                str(n["NodeID"]),
            )
        )
        for index, node in enumerate(group):
            if not node.get("Alive"):
                continue
            resources = node.get("Resources", {})
            hosts.append(
                RayHostInfo(
                    ray_node_id=str(node["NodeID"]),
                    address=address,
                    label=address if len(group) == 1 else f"{address}#{index}",
                    memory_bytes=int(resources.get("memory", 0)),
                    gpus=int(resources.get("GPU", 0)),
                    is_head=_is_head(node),
                    manager_port=int(node.get("NodeManagerPort", 0)),
                )
            )
    return tuple(sorted(hosts, key=lambda h: (_address_key(h.address), h.label)))


def _is_head(node: Mapping[str, Any]) -> bool:
    return "node:__internal_head__" in node.get("Resources", {})


def _address_key(address: str) -> tuple[Any, ...]:
    parts = address.split(".")
    if len(parts) == 4 and all(p.isdigit() for p in parts):
        return (0, *(int(p) for p in parts))
    return (1, address)


def spread(stages: int, slots: int) -> list[int]:
    """Which of ``slots`` (in order) each of ``stages`` goes to: evenly, consecutive
    stages together."""
    return [i * slots // stages for i in range(stages)]


def cpu_stage_nodes(hosts: Sequence[RayHostInfo], stages: int) -> tuple[StageNode, ...]:
    """Stages of a CPU worker: spread over the hosts, the machine's memory shared."""
    if not hosts:
        raise ClusterError("the cluster has no live node")
    out = []
    taken: dict[str, int] = {}
    for slot in spread(stages, len(hosts)):
        host = hosts[min(slot, len(hosts) - 1)]
        j = taken.get(host.label, 0)
        taken[host.label] = j + 1
        node_id = f"{host.label}/cpu{j}"
        spec = NodeSpec(node_id, host.memory_bytes, host.address)
        out.append(StageNode(node_id, host, None, spec))
    return tuple(out)


def gpu_stage_nodes(
    hosts: Sequence[RayHostInfo], stages: int, gpu_memory: Mapping[str, Mapping[int, int]]
) -> tuple[StageNode, ...]:
    """Stages of a GPU worker: spread over every GPU of the cluster (host by host), a
    GPU's memory shared by its stages. ``gpu_memory[ray_node_id][index]``: bytes."""
    gpus = [(host, k) for host in hosts for k in range(host.gpus)]
    if not gpus:
        raise ClusterError("the CUDA worker needs GPUs; no live node of the cluster has one")
    out = []
    taken: dict[tuple[str, int], int] = {}
    for slot in spread(stages, len(gpus)):
        host, k = gpus[slot]
        j = taken.get((host.label, k), 0)
        taken[(host.label, k)] = j + 1
        node_id = f"{host.label}/gpu{k}" + (f".{j}" if j else "")
        memory = gpu_memory.get(host.ray_node_id, {}).get(k)
        if memory is None:
            raise ClusterError(
                f"host {host.label} reports {host.gpus} GPUs to Ray but nvidia-smi there "
                f"does not list GPU {k}"
            )
        device = f"{host.label}/gpu{k}"
        out.append(StageNode(node_id, host, k, NodeSpec(node_id, memory, device)))
    return tuple(out)
