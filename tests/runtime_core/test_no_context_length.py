"""A file whose ``{arch}.context_length`` is 0 states no context length: llama.cpp loads
it and runs it at the context its caller gives (llama-cpp-python 0.3.36 at ``n_ctx``
64; with none to default to, it makes no context: ``scripts/check_refusals_llamacpp.py``).
So here: the facts say 0, a run that says its length runs (``generate``: the run's own
length; ``--max-seq-len``, ``--context``) to the tokens and logits of the same file
stating a context, and one that leaves the length to the file is refused naming it.
Every reader refused the file ("0: it must be in 1..4294967295")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFValueType

import runtime_sim
from runplan import model_facts_from_gguf
from runplan.cli import main as runplan_main
from runplan.config import WorkerCapabilities
from runplan.facts import context_limit
from runtime_core.gguf_slice import check_whole_model
from runtime_cupy.cli.plan import main as cupy_plan_main
from runtime_cupy.serve.chain import WarmChain
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.same_run import assert_same_run

SHAPE = ModelShape(n_layers=2, seed=31)


def no_context_length(folder: Path) -> Path:
    """``SHAPE``'s model, its ``llama.context_length`` 0."""
    return write_model(
        folder / "no-context.gguf",
        SHAPE,
        override_keys={"llama.context_length": (0, GGUFValueType.UINT32)},
    )


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    """(the file stating a context length of 256, the same stating none)."""
    return write_model(tmp_path / "context.gguf", SHAPE), no_context_length(tmp_path)


def test_the_facts_say_none_and_every_stage_loads_it(files: tuple[Path, Path]) -> None:
    _, none = files
    facts = model_facts_from_gguf(none, max_seq_len=64)
    assert (facts.context_length, context_limit(facts), facts.max_seq_len) == (0, None, 64)
    check_whole_model(none, facts.num_layers, WorkerCapabilities())


def test_a_run_of_its_own_length_gives_the_tokens_of_the_file_stating_one(
    files: tuple[Path, Path],
) -> None:
    stated, none = files
    assert_same_run(str(stated), str(none), [5, 77, 300], max_tokens=6)
    # a run past what the other file states: no bound here
    long = runtime_sim.generate(str(none), [5] * 300, max_tokens=2)
    assert long.outcome == "completed"


def test_a_plan_that_leaves_the_length_to_the_file_is_refused_naming_it(
    files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, none = files
    args = ["plan", str(none), "--nodes", "a=1GiB", "--json"]
    assert runplan_main(args) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "inconsistent_model_facts"
    assert "max_seq_len" in error["message"] and "no context length" in error["message"]
    assert runplan_main([*args, "--max-seq-len", "64"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["model"]["max_seq_len"] == 64


def test_runtime_cupy_plan_defaults_to_its_own_length(
    files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, none = files
    assert cupy_plan_main(["--model", str(none), "--stages", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["model"]["max_seq_len"] == 2048


def test_serving_it_needs_a_context(files: tuple[Path, Path]) -> None:
    _, none = files
    with pytest.raises(ValueError, match=r"states no context length.*give the context"):
        WarmChain(str(none), stages=1)
    with pytest.raises(ValueError, match="context 1 is not 2 or more"):
        WarmChain(str(none), stages=1, context=1)
