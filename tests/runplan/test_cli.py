"""``python -m runplan``: tables, JSON, rejections (exit 2) and file errors (exit 1)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from runplan.cli import main, parse_nodes, parse_size
from runplan.rejections import InvalidExtent
from runplan.wire import loads
from tests.fixtures.gguf_models import ModelShape, write_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_model(tmp_path_factory.mktemp("cli") / "tiny.gguf", ModelShape(n_layers=6)))


def _json(capsys: pytest.CaptureFixture[str]) -> dict:  # type: ignore[type-arg]
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out  # exactly one JSON object
    return json.loads(out)


def test_facts_json(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["facts", model, "--json"]) == 0
    facts = _json(capsys)["facts"]
    assert facts["num_layers"] == 6 and facts["architecture"] == "llama"


def test_facts_table(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["facts", model]) == 0
    out = capsys.readouterr().out
    assert "architecture" in out and "llama" in out


def test_plan_json_is_a_plan_the_wire_reads(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "plan",
                model,
                "--nodes",
                "a=1GiB,b=2GiB,c=3GiB",
                "--stages",
                "3",
                "--placement",
                "memory",
                "--json",
            ]
        )
        == 0
    )
    doc = _json(capsys)
    plan = loads(json.dumps(doc["plan"]).encode())
    assert [s.node_id for s in plan.stages] == ["a", "b", "c"]
    assert [m["stage_index"] for m in doc["memory"]] == [0, 1, 2]
    assert all(m["total_bytes"] <= m["device_bytes_available"] for m in doc["memory"])


@pytest.mark.parametrize(
    ("flags", "width"),
    [((), 4), (("--weights", "stored", "--dtype", "f16"), 2), (("--kv-dtype", "f16"), 2),
     (("--weights", "stored", "--dtype", "f16", "--kv-dtype", "f32"), 4),
     (("--dtype", "f16"), 4)],  # the activations' dtype only, with --weights f32
)  # fmt: skip
def test_plan_kv_dtype_is_counted_and_carried(
    model: str, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], width: int
) -> None:
    assert main(["plan", model, "--nodes", "a=1GiB,b=1GiB", "--json", *flags]) == 0
    doc = _json(capsys)
    plan = loads(json.dumps(doc["plan"]).encode())
    assert plan.model.kv_dtype_width_bytes == width
    assert main(["plan", model, "--nodes", "a=1GiB,b=1GiB", "--json", "--kv-dtype", "f32"]) == 0
    f32 = loads(json.dumps(_json(capsys)["plan"]).encode())
    for ours, wide in zip(plan.stages, f32.stages, strict=True):
        assert ours.kv_bytes * 4 == wide.kv_bytes * width


def test_plan_help_says_what_dtype_sets(capsys: pytest.CaptureFixture[str]) -> None:
    """--help said "--dtype: activation and KV-cache dtype"; with --weights f32 (the
    default) the KV caches stay f32 whatever --dtype says."""
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "activation and KV-cache dtype" not in text
    assert "the KV caches' too with --weights stored and no --kv-dtype" in text
    assert "default: f32 with --weights f32, the activations' --dtype with --weights stored" in text


def test_stages_of_a_shared_device_are_shown_against_its_smallest_node(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The planner holds a device's stages to the smallest memory of their nodes: so
    does what the command prints (it showed each node's own, 3 GiB for b)."""
    args = ["plan", model, "--nodes", "a=1GiB@g,b=3GiB@g"]
    assert main([*args, "--json"]) == 0
    memory = _json(capsys)["memory"]
    assert [m["device_bytes_available"] for m in memory] == [2**30, 2**30]
    used = memory[0]["device_bytes_used"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count(f"{100.0 * used / 2**30:.1f}%") == 2, out


@pytest.mark.parametrize("command", ["plan", "split"])
def test_a_stage_count_below_one_is_a_usage_error(
    command: str, model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One validator and one message for both (split said ``--stages 0 is not >= 1``)."""
    out = ["--out", str(tmp_path / "out")] if command == "split" else []
    with pytest.raises(SystemExit) as exc:
        main([command, model, "--nodes", "a=1GiB", "--stages", "0", *out, "--json"])
    assert exc.value.code == 2
    error = _json(capsys)["error"]
    assert error["type"] == "UsageError", error
    assert "argument --stages: '0' is not a positive integer" in error["message"], error


def test_a_stage_count_rejection_names_only_the_counts_it_knows() -> None:
    """A plan not placed yet has no placed stages: not ``placed stages None``."""
    from runplan.rejections import InvalidStageCount

    assert str(InvalidStageCount(40, 30, None, "more stages than layers")) == (
        "invalid_stage_count: stage_count 40: more stages than layers (layers 30)"
    )
    assert str(InvalidStageCount(2, 30, 3, "not the number of placed stages")) == (
        "invalid_stage_count: stage_count 2: not the number of placed stages "
        "(layers 30, placed stages 3)"
    )


def test_plan_table(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", model, "--nodes", "a=1GiB,b=1GiB@gpu,c=1GiB@gpu"]) == 0
    out = capsys.readouterr().out
    for word in ("stage", "node", "layers", "KV cache", "use", "b @gpu"):
        assert word in out


def test_a_rejection_prints_its_code_and_values_and_exits_2(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", model, "--nodes", "a=1KiB,b=1GiB", "--json"]) == 2
    rejection = _json(capsys)["rejection"]
    assert rejection["code"] == "insufficient_memory"
    assert rejection["device"] == "a" and rejection["bytes_available"] == 1024
    assert main(["plan", model, "--nodes", "a=1KiB,b=1GiB"]) == 2
    err = capsys.readouterr().err
    assert "insufficient_memory" in err and "1024" in err


def test_too_many_stages_is_a_rejection(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = ",".join(f"n{i}=1GiB" for i in range(7))
    assert main(["plan", model, "--nodes", nodes, "--json"]) == 2
    assert _json(capsys)["rejection"]["code"] == "invalid_stage_count"


def test_a_broken_file_exits_1_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    assert main(["facts", str(bad), "--json"]) == 1
    error = _json(capsys)["error"]
    assert error["type"] == "GgufError" and str(bad) in error["message"]


def test_an_error_names_a_path_with_brackets_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Messages are printed as text, not as rich markup: ``[v2]`` is not a style."""
    bad = tmp_path / "model[v2].gguf"
    bad.write_bytes(b"nope")
    assert main(["facts", str(bad)]) == 1
    assert str(bad) in capsys.readouterr().err


def test_sizes_and_nodes_parse() -> None:
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("1.5KiB") == 1536
    assert parse_size("100") == 100
    nodes = parse_nodes("gpu0=80GiB,gpu1=24GiB@cuda:1")
    assert [(n.node_id, n.memory_bytes, n.device) for n in nodes] == [
        ("gpu0", 80 * 2**30, None),
        ("gpu1", 24 * 2**30, "cuda:1"),
    ]


def test_bad_node_syntax_is_a_usage_error(model: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", model, "--nodes", "gpu0:80GiB"])
    assert exc.value.code == 2


@pytest.mark.parametrize("nodes", ["a=1GiB@", "a=1GiB@cuda:0,b=1GiB@"])
def test_an_empty_device_is_a_usage_error_naming_the_node(
    model: str, nodes: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``NODE=SIZE@`` with nothing after the ``@`` was taken as a node of its own."""
    with pytest.raises(SystemExit) as exc:
        main(["plan", model, "--nodes", nodes])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    bad = nodes.rsplit(",", maxsplit=1)[-1]
    assert len(lines) == 1 and "--nodes" in lines[0] and repr(bad) in lines[0], lines
    assert "no device after @" in lines[0], lines


@pytest.mark.parametrize("value", ["-5", "0", "many"])
def test_a_bad_max_seq_len_is_one_line_naming_it(
    model: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", model, "--nodes", "a=1GiB", "--max-seq-len", value])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--max-seq-len" in lines[0] and repr(value) in lines[0], lines


def test_module_entry_point_runs(model: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "runplan", "facts", model, "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["facts"]["num_layers"] == 6


@pytest.mark.parametrize("node", ["a[/]", "[bold]x", "n:smile:"])
def test_node_ids_and_run_ids_print_as_given_not_as_markup(
    model: str, node: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """User text reaches the table literally: ``[/]`` does not crash rich, ``[bold]``
    is not a style, ``:smile:`` is not an emoji."""
    assert main(["plan", model, "--nodes", f"{node}=1GiB", "--run-id", f"r{node}"]) == 0
    out = capsys.readouterr().out
    assert node in out and f"r{node}" in out, out
    assert main(["plan", model, "--nodes", f"{node}=1KiB", "--run-id", f"r{node}"]) == 2
    assert repr(node) in capsys.readouterr().err  # the rejection names the node as it is


def test_a_table_written_to_a_pipe_keeps_its_cells_whole(
    model: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a terminal (a file, a pipe, a script reading the table): the cells are whole
    (rich cut them to its 80 columns: ``stage-0-a…``), as wide as the table needs;
    ``COLUMNS``, where set, bounds them as a terminal's width does."""
    monkeypatch.delenv("COLUMNS", raising=False)
    nodes = [f"host-{i}-with-a-long-name.rack-{i}.example.internal" for i in range(3)]
    argv = ["plan", model, "--nodes", ",".join(f"{n}=1GiB" for n in nodes)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in nodes) and "…" not in out, out
    monkeypatch.setenv("COLUMNS", "60")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 60, out


def test_a_path_with_markup_prints_as_given(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m[bold]x:smile:.gguf"
    path.symlink_to(model)
    assert main(["facts", str(path)]) == 0
    out = capsys.readouterr().out
    assert "m[bold]x:smile:" in out  # the title: the model id from the file name
    assert str(path) in "".join(out.split())  # the source row, folded (no spaces in it)


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_split_into_an_out_that_cannot_be_a_folder_is_one_line_naming_it(
    model: str, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "taken"
    file.write_text("")
    out = file if kind == "a file" else file / "sub"
    args = ["split", model, "--stages", "2", "--out", str(out)]
    assert main([*args, "--json"]) == 1
    error = _json(capsys)["error"]
    assert error["type"] == "OutputFolderError" and "--out" in error["message"]
    assert str(out) in error["message"]
    assert main(args) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0], lines


def test_a_refused_split_makes_no_out_folder(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "shards"
    assert main(["split", model, "--stages", "999", "--out", str(out), "--json"]) == 2
    assert "rejection" in _json(capsys)
    assert not out.exists()


@pytest.mark.parametrize("size", ["9" * 400 + "GiB", "9" * 310, "9" * 5000 + "GB"])
def test_a_size_too_large_for_a_number_is_one_line_naming_it(
    model: str, size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", model, "--nodes", f"a={size}"])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--nodes" in lines[0] and "too large" in lines[0], lines


@pytest.mark.parametrize("size", ["9" * 5000 + "GiB", "x" * 5000])
def test_a_bad_size_of_thousands_of_characters_is_named_shortened(size: str) -> None:
    """A size past int's 4300 digits is a size error (not Python's ValueError, which
    argparse words "invalid parse_nodes value"), and names the value by its ends."""
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        parse_size(size)
    message = str(exc.value)
    assert "size" in message and f"({len(size)} characters)" in message, message
    assert len(message) < 200, message


def test_memory_the_wire_cannot_carry_is_a_rejection_naming_the_node(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", model, "--nodes", f"a={2**64}", "--json"]) == 2
    rejection = _json(capsys)["rejection"]
    assert rejection["code"] == "invalid_config"
    assert rejection["field"] == "nodes[0].memory_bytes"


@pytest.mark.parametrize(
    ("size", "bytes_"),
    [
        ("1.001GB", 1_001_000_000),  # a float read 1,000,999,999
        ("9007199254740993", 2**53 + 1),  # and 2**53
        ("18446744073709551615", 2**64 - 1),  # and 2**64, which no plan carries
        ("1.1GiB", 1_181_116_006),  # 1,181,116,006.4: the whole bytes
        ("0.0000000000009094947017729282379150390625TiB", 1),  # 2**-40 TiB
        ("1." + "0" * 5000 + "1GB", 10**9),  # digits past any unit's fraction
        ("0" * 5000 + "1GB", 10**9),  # leading zeros past int's 4300 digits
        ("0" * 5000 + "GB", 0),
        ("0" * 5000 + ".5KiB", 512),
    ],
)
def test_a_size_is_counted_to_the_byte(size: str, bytes_: int) -> None:
    assert parse_size(size) == bytes_


def test_the_most_memory_a_plan_carries_plans(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``2**64 - 1`` bytes, written out: once read as a float, 2**64, and refused
    (invalid_config) naming a number the command line did not hold."""
    assert main(["plan", model, "--nodes", f"a={2**64 - 1},b=1GiB", "--json"]) == 0
    memory = _json(capsys)["memory"]
    assert memory[0]["device_bytes_available"] == 2**64 - 1


def test_an_extent_with_no_expected_value_is_told_without_one(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An extent past the header's u64 that no fact fixes prints its value and reason, not
    "(expected None)"; its JSON keeps ``expected``, null."""
    nodes = ["--nodes", "a=1GiB", "--max-seq-len", "9" * 23]
    assert main(["plan", model, *nodes]) == 2
    err = capsys.readouterr().err
    assert "invalid_extent" in err and "overflows the header's u64 extent" in err, err
    assert "expected" not in err, err
    assert main(["plan", model, *nodes, "--json"]) == 2
    rejection = _json(capsys)["rejection"]
    assert rejection["code"] == "invalid_extent" and rejection["expected"] is None
    assert "expected" not in rejection["message"], rejection
    assert "(expected 4)" in str(InvalidExtent("edge 2", 8, 4, "does not follow the facts"))
