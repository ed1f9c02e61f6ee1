"""A warm chain that lost stages and finds no placement over the live nodes: one typed
error (``Unplaced``) naming the live nodes it had, at once, before any process starts."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from runplan import NodeSpec
from runplan.memory import plan_stage_memory
from runtime_cupy.hosts.local import LocalProcessHost
from runtime_cupy.serve.chain import ChainError, Unplaced, WarmChain


class _Cluster(LocalProcessHost):
    """A host that knows its live nodes (``KnowsLiveNodes``), as a Ray cluster's does:
    ``live`` of the nodes known."""

    def __init__(self, live: Sequence[str]) -> None:
        super().__init__()
        self.live = set(live)

    def live_nodes(
        self, known: Sequence[tuple[NodeSpec, int | None]], worker: str
    ) -> tuple[tuple[NodeSpec, int | None], ...]:
        return tuple((spec, device) for spec, device in known if spec.node_id in self.live)


@pytest.mark.parametrize(
    ("live", "said"),
    [
        ((), "no live node is left"),
        (("n0",), "1 live node (n0)"),
    ],
)
def test_no_placement_over_the_live_nodes_is_one_typed_error_naming_them(
    tiny: str, live: tuple[str, ...], said: str
) -> None:
    # Each node holds one stage's share of the model, not the whole model: a chain that
    # lost nodes n1 and n2 fits on no live node.
    probe = WarmChain(tiny, stages=3, context=64)
    room = max(m.total for m in plan_stage_memory(probe.facts, probe.capabilities, probe.template))
    nodes = tuple(NodeSpec(f"n{i}", room) for i in range(3))
    chain = WarmChain(tiny, stages=3, context=64, host=_Cluster(live), nodes=nodes, recover=True)
    chain.replacer.lost = (1, 2)  # as Replacer.lose leaves it after the loss
    with pytest.raises(Unplaced) as info:
        chain._place_again()
    assert isinstance(info.value, ChainError)
    assert info.value.live == live
    message = str(info.value)
    assert message.startswith(f"the chain lost a stage and cannot be placed again over {said}: ")
    assert "no placement after losing stages" in message, message
    assert chain.trouble == message and not chain.placeable


@pytest.mark.parametrize(
    ("spares", "said"),
    [
        ((), "(stage 1 started again on its own node 'n1')"),
        (("s0",), "(stage 1's range on spare node 's0')"),
    ],
)
def test_the_placement_log_says_where_a_lost_range_went(
    tiny: str, spares: tuple[str, ...], said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A lost stage whose node is still live and no spare there: its stage starts again
    on its own node, and the log says so (it said "the lost ranges on spare nodes")."""
    nodes = tuple(NodeSpec(f"n{i}", 2**40) for i in range(3))
    chain = WarmChain(
        tiny,
        stages=3,
        context=64,
        host=_Cluster(("n0", "n1", "n2", *spares)),
        nodes=nodes,
        spares=tuple(NodeSpec(s, 2**40) for s in spares),
        recover=True,
    )
    chain.replacer.lost = (1,)  # its process died; its node is live
    with caplog.at_level("WARNING", logger="runtime_cupy.serve.recovery"):
        chain._place_again()
    placed = [r.getMessage() for r in caplog.records if "new placement" in r.getMessage()]
    assert len(placed) == 1 and placed[0].endswith(said), placed
    assert "spare" not in placed[0] or spares, placed
