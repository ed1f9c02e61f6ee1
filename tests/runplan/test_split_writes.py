"""How ``split`` writes its files (``runplan.whole_file``): each through a partial file
of its own, whole or not at all, with errors naming the file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from runplan import model_facts_from_gguf
from runplan.cli import main
from runplan.content import source_content
from runplan.gguf_header import GgufHeader
from runplan.plan import RunPlan
from runplan.rejections import InvalidStageCount
from runplan.shard_file import WriteProgress, write_shard
from runplan.shards import MANIFEST_NAME, SliceParts, slice_tensor_names
from runplan.split import split_model, split_plan
from tests.fixtures.gguf_models import ModelShape, write_model

SHAPE = ModelShape(n_layers=5, tied=True, rope_freqs=True, quant="Q8_0")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("src") / "tiny.gguf", SHAPE)


def _split(model: Path, out: Path, *extra: str) -> int:
    return main(["split", str(model), "--stages", "2", "--out", str(out), "--json", *extra])


def test_a_symlink_planted_at_a_partial_files_name_is_not_written_through(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``NAME.partial`` was a fixed name opened with ``wb``: a symlink there (another
    user's, in a shared folder) had split overwrite the file it points at."""
    out = tmp_path / "out"
    out.mkdir()
    victims = []
    for name in ("tiny.stage-0-of-2.gguf", MANIFEST_NAME):
        victim = tmp_path / f"victim-{name}"
        victim.write_text("precious")
        (out / f"{name}.partial").symlink_to(victim)
        victims.append(victim)
    assert _split(model, out) == 0, capsys.readouterr()
    assert [v.read_text() for v in victims] == ["precious", "precious"]
    assert json.loads((out / MANIFEST_NAME).read_text())["model_id"] == "tiny"
    assert (out / "tiny.stage-0-of-2.gguf").read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in out.glob("*.partial")) == [
        "manifest.json.partial",
        "tiny.stage-0-of-2.gguf.partial",
    ]  # the planted links, left as they were


def test_two_writers_of_one_shard_each_write_a_file_of_their_own(
    model: Path, tmp_path: Path
) -> None:
    """Two splits into one ``--out`` shared one ``.partial`` (a fixed name): the second
    truncated and rewrote the first's file, which then went on writing into the second's
    shard, and failed renaming a partial file that was gone."""
    header = GgufHeader.read(model)
    content = source_content(header)
    first, second = SliceParts(0, 2, True, False), SliceParts(2, 5, False, True)

    def write(parts: SliceParts, path: Path, during: WriteProgress | None = None) -> int:
        names = slice_tensor_names(header.tensors, parts)
        return write_shard(
            header, names, parts, content.key, content.tensor_sha256, "tiny", path, during
        )

    alone = tmp_path / "alone.gguf"
    write(first, alone)
    target = tmp_path / "shared.gguf"
    interleaved: list[int] = []

    def other_writer(done: int, total: int) -> None:
        if not interleaved:  # once, with the first writer's file half written
            interleaved.append(write(second, target))

    size = write(first, target, other_writer)
    assert interleaved, "the second writer never ran"
    assert target.read_bytes() == alone.read_bytes()  # the last renamed, whole
    assert size == alone.stat().st_size
    assert not list(tmp_path.glob("*.partial"))


def test_a_split_killed_mid_shard_leaves_a_partial_file_the_next_split_removes(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A split SIGKILLed while it writes a shard cannot remove its partial file; each
    one stayed in ``--out`` for good, however often the split ran again. The next
    writer of the shard removes it (no process holds its lock); a link planted under
    such a name is left as it is."""
    out = tmp_path / "out"
    code = (
        "import os, signal\n"
        "from runplan import model_facts_from_gguf\n"
        "from runplan.split import split_model, split_plan\n"
        f"plan = split_plan(model_facts_from_gguf({str(model)!r}), 2, None, 'even')\n"
        "def progress(what, done, total):\n"
        "    if what.endswith('.gguf') and done:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        f"split_model({str(model)!r}, plan, {str(out)!r}, progress=progress)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = list(out.glob("*.partial"))
    assert [p.name.split(".")[:3] for p in left] == [["tiny", "stage-0-of-2", "gguf"]]
    victim = tmp_path / "victim"
    victim.write_text("precious")
    planted = out / "tiny.stage-0-of-2.gguf.0123456789abcdef.partial"
    planted.symlink_to(victim)
    assert _split(model, out) == 0, capsys.readouterr()
    assert list(out.glob("*.partial")) == [planted]
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in out.glob("*.gguf")) == [
        "tiny.stage-0-of-2.gguf",
        "tiny.stage-1-of-2.gguf",
    ]


def _split_under_file_size_limit(
    model: Path, out: Path, limit: int
) -> subprocess.CompletedProcess[str]:
    """``split`` with every file it writes limited to ``limit`` bytes (``RLIMIT_FSIZE``;
    Python ignores ``SIGXFSZ``): a write past it fails as on a full disk, short."""
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
        "from runplan.cli import main\n"
        f"sys.exit(main(['split', {str(model)!r}, '--stages', '2', '--out', {str(out)!r},"
        " '--json']))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, env=os.environ
    )


def test_a_shard_cut_short_by_a_full_disk_is_an_error_naming_it_and_leaves_nothing(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk during a shard's last bytes: ``GGUFWriter``'s numpy ``tofile`` dropped
    the buffered tail without a word, and the short shard was renamed into place (split
    exited 0). A larger short write said only "8704 requested and 8056 written"."""
    whole = tmp_path / "whole"
    assert _split(model, whole) == 0
    size = (whole / "tiny.stage-0-of-2.gguf").stat().st_size
    for short in (48, 9000):  # within the last buffer; a write larger than it
        out = tmp_path / f"short-{short}"
        proc = _split_under_file_size_limit(model, out, size - short)
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        message = json.loads(proc.stdout)["error"]["message"]
        assert f"writing {str(out / 'tiny.stage-0-of-2.gguf')!r}" in message, message
        assert "File too large" in message and "bytes free" in message, message
        assert not out.exists()  # no shard, no partial file, no manifest: not its folder


def test_a_folder_where_a_file_goes_is_named_as_in_the_way(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder at a shard's name was reported as the partial file failing to be
    written, with the file system's free bytes; the manifest's failure named only its
    partial file."""
    for name in ("tiny.stage-1-of-2.gguf", MANIFEST_NAME):
        out = tmp_path / name.replace(".", "-")
        (out / name).mkdir(parents=True)
        assert _split(model, out) == 1
        message = json.loads(capsys.readouterr().out)["error"]["message"]
        assert f"writing {str(out / name)!r}: a folder of that name is in the way" in message
        assert "bytes free" not in message and ".partial" not in message, message
        assert not list(out.glob("*.partial"))


def test_a_stage_count_past_the_layers_is_refused_before_a_node_is_made_for_each(
    model: Path,
) -> None:
    """``--stages 30000000`` made one node of unbounded memory per stage before the
    planner refused the count: minutes and gigabytes."""
    facts = model_facts_from_gguf(model)
    tracemalloc.start()
    try:
        plan = split_plan(facts, 10**6, None, "even")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(plan, InvalidStageCount), plan
    assert (plan.stage_count, plan.num_layers, plan.reason) == (
        10**6,
        SHAPE.n_layers,
        "more stages than layers",
    )
    assert peak < 4 << 20, peak  # a million nodes took hundreds of MiB


def test_an_empty_out_is_a_usage_error_not_the_current_folder(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out ""`` (an unset variable) was ``Path("")``, the current folder: the shards
    and a manifest were written there."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(SystemExit) as exc:
        main(["split", str(model), "--stages", "2", "--out", ""])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "argument --out: '' names no folder" in err, err
    assert not list(here.iterdir())


def test_a_split_cancelled_before_its_first_shard_removes_the_folders_it_made(
    model: Path, tmp_path: Path
) -> None:
    """Ctrl-C while the source is hashed: the folders of ``--out`` this split made, still
    empty, go again (it left them); a folder that was there stays."""
    plan = split_plan(model_facts_from_gguf(model), 2, None, "even")
    assert isinstance(plan, RunPlan)

    def cancelled(_what: str, _done: int, _total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        split_model(str(model), plan, tmp_path / "made" / "out", progress=cancelled)
    assert os.listdir(tmp_path) == []
    (tmp_path / "there").mkdir()
    with pytest.raises(KeyboardInterrupt):
        split_model(str(model), plan, tmp_path / "there", progress=cancelled)
    assert os.listdir(tmp_path) == ["there"]


def test_runplan_split_cancelled_before_its_first_shard_leaves_no_folder(
    smollm2_path: str, tmp_path: Path
) -> None:
    """``python -m runplan split`` cancelled (Ctrl-C) as it begins: exit 130 and no
    ``--out`` folder (it made it first, and left it empty)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    out = tmp_path / "made" / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runplan", "split", smollm2_path, "--stages", "3",
         "--out", str(out), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    while not out.is_dir():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert os.listdir(tmp_path) == []
