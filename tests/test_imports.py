"""The import graph of ``src/`` (``tests/support/import_graph.py``): dependencies point
down only (``runplan`` imports no runtime, ``runtime_core`` only ``runplan``, the two
runtimes never each other), no module reaches itself again through its imports, and
only the edges package constructs a medium."""

from __future__ import annotations

from tests.support.import_graph import ALLOWED, component, cycles, import_graph


def test_the_graph_sees_what_the_sources_import() -> None:
    graph = import_graph()
    assert "runplan.wire" in graph["runplan"] or "runplan.plan" in graph["runplan"]
    assert "runtime_cupy.workers" in graph["runtime_cupy.process.stage_process"]
    # an import inside a function counts: the CUDA worker loads its backend at bind
    assert "runtime_cupy.cuda.backend" in graph["runtime_cupy.cuda.worker"]


def test_the_cycle_finder_finds_a_cycle_and_names_its_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_anywhere_in_src() -> None:
    graph = import_graph()
    found = cycles(graph)
    lines = []
    for cycle in found:
        tied = sorted(set(cycle))
        lines.append(" -> ".join(cycle))
        # every other module of the component, each on a cycle through the first
        members = {m for m in graph if m in component(graph, cycle[0])} - set(tied)
        lines += [f"    (and {m})" for m in sorted(members)]
    assert not found, "import cycles:\n" + "\n".join(lines)


def test_dependencies_point_down_only() -> None:
    wrong = sorted(
        (module, dep)
        for module, deps in import_graph().items()
        for dep in deps
        if dep.split(".")[0] != module.split(".")[0]
        and dep.split(".")[0] not in ALLOWED[module.split(".")[0]]
    )
    assert not wrong, "imports against the layering:\n" + "\n".join(f"{a} -> {b}" for a, b in wrong)


#: A medium's own modules: only ``runtime_cupy.edges`` itself imports them (through
#: ``edges.media``), so adding a medium never touches a host, a loop or a worker. The
#: TCP handshake (``edges.handshake``) and the frame seals (``edges.tcp_seal``) are
#: protocol pieces, not media: the other authenticated TCP links (the slice server's,
#: ``runtime_cupy.slices.protocol``) open and seal their frames with the same code.
MEDIUM_MODULES = ("shm", "tcp", "tcp_consumer", "tcp_door", "tcp_producer", "tcp_frames")


def test_hosts_and_loops_reach_the_media_through_the_edge_port_only() -> None:
    media = {f"runtime_cupy.edges.{m}" for m in MEDIUM_MODULES}
    wrong = sorted(
        (module, dep)
        for module, deps in import_graph().items()
        if not module.startswith("runtime_cupy.edges")
        for dep in deps & media
    )
    assert not wrong, "a medium constructed outside runtime_cupy.edges:\n" + "\n".join(
        f"{a} -> {b}" for a, b in wrong
    )
