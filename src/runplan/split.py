"""``python -m runplan split MODEL --stages N [--nodes ...] [--placement ...] --out DIR``:
cut a model into one GGUF file per stage of a plan, and a manifest.

The plan is ``plan_run``'s for the node pool given (``--nodes``, as ``plan`` takes it),
or for ``N`` nodes of unbounded memory; the stages' layer ranges decide the shards.
Shard ``i`` holds what stage ``i`` loads (``runplan.shards.slice_tensor_names``) and is
written with ``gguf.GGUFWriter`` (``runplan.shard_file``); ``DIR/manifest.json`` names
them, and is written last: a folder with a manifest is whole (an earlier split's
manifest there is removed before the first shard is written over). ``--model DIR`` (or the
manifest) then loads each stage from its own shard, and ``facts`` on a shard says what
it holds.

This command reads every tensor (to hash it and to copy it) and writes files: it is the
one part of ``runplan`` that does more than read headers.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from attrs import frozen
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from runplan.config import RuntimeConfig, WorkerCapabilities
from runplan.content import source_content
from runplan.facts import ModelFacts
from runplan.gguf_error import GgufError
from runplan.gguf_header import GgufHeader
from runplan.placement import Placement
from runplan.plan import RunPlan
from runplan.planner import plan_run
from runplan.pool import NodePool, NodeSpec
from runplan.rejections import PlanRejection
from runplan.shard_file import recorded_problem, write_shard
from runplan.shards import (
    MANIFEST_NAME,
    ShardEntry,
    ShardManifest,
    SliceParts,
    manifest_json,
    model_id_problem,
    slice_tensor_names,
)
from runplan.whole_file import whole_file

#: The memory of each node when no pool is given: the split is then by layers only.
UNBOUNDED = 2**62
#: ``progress(what, done_bytes, total_bytes)``.
SplitProgress = Callable[[str, int, int], None]


@frozen
class SplitResult:
    manifest_path: str
    manifest: ShardManifest
    file_bytes: tuple[int, ...]  # each shard file's size


def split_plan(
    facts: ModelFacts,
    stages: int,
    nodes: tuple[NodeSpec, ...] | None,
    placement: str,
) -> RunPlan | PlanRejection:
    """The plan whose stages the shards follow: ``nodes`` (or ``stages`` nodes of
    unbounded memory), weights counted as stored. Past one node more than the model's
    layers, no node is made: the planner refuses such a count before it looks at the
    pool (``--stages 30000000`` made as many nodes first, minutes and gigabytes)."""
    count = min(stages, facts.num_layers + 1)
    pool_nodes = nodes or tuple(NodeSpec(f"stage-{i}", UNBOUNDED) for i in range(count))
    config = RuntimeConfig(
        run_id="split",
        max_tokens=1,
        worker=WorkerCapabilities(
            name="stored", weight_bytes_per_element=0, kv_bytes_per_element=0
        ),
    )
    chosen = tuple(n.node_id for n in pool_nodes[:stages])
    place = Placement.even(chosen) if placement == "even" else Placement.by_memory(chosen)
    return plan_run(
        facts, config, NodePool("orchestrator", pool_nodes), stage_count=stages, placement=place
    )


def shard_file_name(model_id: str, stage_index: int, stage_count: int) -> str:
    # Not ``-0000i-of-0000n.gguf``: that names a llama.cpp split set.
    return f"{model_id}.stage-{stage_index}-of-{stage_count}.gguf"


def split_model(
    model_path: str,
    plan: RunPlan,
    out: str | os.PathLike[str],
    *,
    placement: str = "even",
    progress: SplitProgress | None = None,
) -> SplitResult:
    """Write one shard per stage of ``plan`` and the manifest into ``out`` (``ValueError``
    for a model id that cannot name a file, before anything is written; ``GgufError``
    for shards read through a manifest that no longer hold what they record, once
    hashed, before any shard is written). The folders of ``out`` that it makes are
    removed again where it fails or is cancelled (Ctrl-C) while they are empty: an
    empty folder was left, named as the split's."""
    problem = model_id_problem(plan.model.model_id)
    if problem is not None:
        raise ValueError(f"model id {plan.model.model_id!r} cannot name the shards: {problem}")
    folder = Path(out)
    made = missing_folders(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with removed_if_empty(made):
        return _write_split(model_path, plan, folder, placement, progress)


def missing_folders(folder: Path) -> list[Path]:
    """The folders ``folder.mkdir(parents=True)`` makes: those of its path not there
    yet, deepest first."""
    missing = []
    for each in (folder, *folder.parents):
        if os.path.lexists(each):
            break
        missing.append(each)
    return missing


@contextlib.contextmanager
def removed_if_empty(made: list[Path]) -> Iterator[None]:
    """Where the block fails or is cancelled, the folders ``made`` (deepest first) are
    removed while they are empty; one that holds anything stays."""
    try:
        yield
    except BaseException:
        for each in made:
            with contextlib.suppress(OSError):  # not empty (or gone): it stays
                each.rmdir()
        raise


def _write_split(
    model_path: str,
    plan: RunPlan,
    folder: Path,
    placement: str,
    progress: SplitProgress | None,
) -> SplitResult:
    header = GgufHeader.read(model_path)
    model_id = plan.model.model_id

    def hashed(done: int, total: int) -> None:
        if progress is not None:
            progress("hash", done, total)

    content = source_content(header, progress=hashed)
    problem = recorded_problem(header, content)
    if problem is not None:  # split again, the damage would be recorded as the source
        raise GgufError(header.source_paths[0], f"will not split it again: {problem}")
    names_written = [
        shard_file_name(model_id, s.stage_index, plan.stage_count) for s in plan.stages
    ]
    if any(os.path.lexists(folder / n) for n in names_written):  # an earlier split's, over
        _drop_manifest(folder / MANIFEST_NAME)
    entries: list[ShardEntry] = []
    sizes: list[int] = []
    for stage in plan.stages:
        parts = SliceParts.of_stage(stage)
        names = slice_tensor_names(header.tensors, parts)
        name = shard_file_name(model_id, stage.stage_index, plan.stage_count)

        def wrote(done: int, total: int, what: str = name) -> None:
            if progress is not None:
                progress(what, done, total)

        sizes.append(
            write_shard(
                header,
                names,
                parts,
                content.key,
                content.tensor_sha256,
                model_id,
                folder / name,
                wrote,
            )
        )
        tensor_bytes = sum(header.tensors[n].n_bytes for n in names)
        entries.append(ShardEntry(name, parts, tensor_bytes))
    manifest = ShardManifest(
        model_id=model_id,
        source=content.key,
        block_count=plan.model.num_layers,
        shards=tuple(entries),
        nodes=tuple(s.node_id for s in plan.stages),
        placement=placement,
    )
    target = folder / MANIFEST_NAME
    with whole_file(target) as file:
        file.write(manifest_json(manifest).encode("utf-8"))
    return SplitResult(str(target), manifest, tuple(sizes))


def _drop_manifest(path: Path) -> None:
    """Remove an earlier split's manifest before the first of its shards is written over
    (only then: a split whose shards have other names leaves it, and its whole split,
    until its own manifest replaces it): a split cut short would leave it naming shards
    of two splits, in a folder that its manifest says is whole. A regular file is
    removed, or a symbolic link itself (never what it points to); anything else is left
    for the manifest's own write to refuse.
    ``OSError`` naming the manifest where it cannot be removed (nothing written yet)."""
    try:
        kind = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(kind) or stat.S_ISLNK(kind)):
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot remove the earlier split's manifest {path}: {exc.strerror}"
        ) from exc


class _Bars:
    """Progress bars on standard error: hashing, then each shard."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            TextColumn("{task.description}", markup=False),  # file names as they are
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            console=console,
            transient=False,
        )
        self.tasks: dict[str, Any] = {}

    def __call__(self, what: str, done: int, total: int) -> None:
        task = self.tasks.get(what)
        if task is None:
            label = "hashing tensors" if what == "hash" else f"writing {what}"
            task = self.tasks[what] = self.progress.add_task(label, total=total)
        self.progress.update(task, completed=done, total=total)
