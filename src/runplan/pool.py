"""The nodes a run may use. A node hosts one stage (one worker process)."""

from __future__ import annotations

from attrs import frozen

from runplan._fields import int_field, str_field, tuple_field, typed_field


@frozen
class NodeSpec:
    """One stage host. Nodes naming the same ``device`` share its memory (several
    stages on one GPU); a node without a device has its memory to itself."""

    node_id: str = str_field()
    memory_bytes: int = int_field()
    device: str | None = typed_field((str, type(None)), default=None)

    @property
    def device_key(self) -> tuple[str, str]:
        """What memory is accounted under: ("device", name), else ("node", node_id)."""
        return ("device", self.device) if self.device is not None else ("node", self.node_id)


@frozen
class NodePool:
    """The candidate nodes of a run and the node id of its orchestrator."""

    orchestrator_node_id: str = str_field()
    nodes: tuple[NodeSpec, ...] = tuple_field(NodeSpec)
