"""Offline batches (issue 22): ``runtime_cupy.generate_batch`` runs many prompts at once
on one chain and yields each result as it completes, each the tokens of the same prompt
run alone; ``python -m runtime_cupy --prompts-file FILE.jsonl`` prints one JSON line per
prompt; the chain leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from runtime_cupy import generate, generate_batch
from tests.support.hygiene import run_resources

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

PROMPTS = [[5, 77, 30, 12, 9], [3, 4], [100, 7, 7, 7, 7, 7, 7, 2], [42], [9, 8, 7]]


@pytest.fixture(scope="module")
def alone(tiny: str) -> list[tuple[int, ...]]:
    """Each prompt's tokens run alone."""
    return [generate(tiny, p, stages=2, max_tokens=7, worker="numpy").tokens for p in PROMPTS]


@pytest.fixture
def chains_made(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """The keyword arguments of each ``WarmChain`` a batch makes (``runtime_cupy.batch``'s,
    recorded before the chain plans: those the planner refused too)."""
    from runtime_cupy import batch
    from runtime_cupy.serve.chain import WarmChain

    made: list[dict[str, object]] = []

    class Recorded(WarmChain):
        def __init__(self, *args: object, **kwargs: object) -> None:
            made.append(kwargs)
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(batch, "WarmChain", Recorded)
    return made


def test_every_prompt_at_once_gives_its_tokens_alone(
    tiny: str, alone: list[tuple[int, ...]]
) -> None:
    seen: dict[int, tuple[int, ...]] = {}
    chains = set()
    for index, result in generate_batch(tiny, PROMPTS, stages=2, max_tokens=7, worker="numpy"):
        assert index not in seen
        assert result.outcome == "completed", result.fault
        seen[index] = result.tokens
        chains.add(result.chain_id)
    assert [seen[i] for i in range(len(PROMPTS))] == alone
    (chain_id,) = chains  # one chain ran them all
    assert run_resources(chain_id) == []


def test_max_concurrent_bounds_the_prompts_in_flight(
    tiny: str, alone: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max_concurrent=2``: at most two runs submitted and not yet ended at any moment,
    though the KV budget of two runs of the longest prompt admits more of the short
    ones (it ran all five at once); the next prompt starts as a run ends."""
    from runtime_cupy import batch
    from runtime_cupy.serve.chain import WarmChain

    in_flight: list[int] = [0]
    peak: list[int] = [0]

    class Counted(WarmChain):
        def submit(self, *args: object, on_done: object = None, **kwargs: object) -> object:
            if on_done is None:  # the chain's own (its warm-up), not a prompt's
                return super().submit(*args, **kwargs)  # type: ignore[arg-type]

            def ended(run: object) -> None:
                in_flight[0] -= 1
                on_done(run)  # type: ignore[operator]

            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            return super().submit(*args, on_done=ended, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(batch, "WarmChain", Counted)
    results = dict(
        generate_batch(tiny, PROMPTS, stages=2, max_tokens=7, worker="numpy", max_concurrent=2)
    )
    assert [results[i].tokens for i in range(len(PROMPTS))] == alone
    assert peak[0] == 2


def test_the_prompts_file_prints_one_json_line_per_prompt(
    tiny: str, tmp_path: Path, alone: list[tuple[int, ...]]
) -> None:
    file = tmp_path / "prompts.jsonl"
    # a byte-order mark, CRLF line ends, and a line whose text holds U+2028 raw (JSON
    # Lines ends a line at a line feed only)
    text = json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False)
    body = "\r\n".join(json.dumps({"prompt_ids": p}) for p in PROMPTS[:3])
    file.write_text("\ufeff" + body + "\r\n" + text + "\n", encoding="utf-8")
    args = ["--model", tiny, "--stages", "2", "--worker", "numpy", "--max-tokens", "7"]
    done = subprocess.run(
        [sys.executable, "-m", "runtime_cupy", *args, "--prompts-file", str(file)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(line["index"] for line in lines) == [0, 1, 2, 3]
    for line in lines:
        assert line["outcome"] == "completed"
        if line["index"] < 3:
            assert tuple(line["tokens"]) == alone[line["index"]]
    file.write_text('{"prompt_ids": [1, 2]}\n{"prompt": 3}\n')
    bad = subprocess.run(
        [sys.executable, "-m", "runtime_cupy", *args, "--prompts-file", str(file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "line 2" in bad.stderr, bad.stderr


def test_the_prompts_file_with_json_prints_one_object(
    tiny: str,
    tmp_path: Path,
    alone: list[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With ``--json``, standard output is one object (ARCHITECTURE.md's rule for every
    ``--json``): ``results`` in the file's order, the counts, and ``error`` when a
    prompt did not complete; each completion is a line on standard error meanwhile."""
    from runtime_cupy.cli import main as cli
    from runtime_cupy.cli import prompts_file

    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt_ids": p}) + "\n\n" for p in PROMPTS[:3]))
    argv = ["--model", tiny, "--stages", "2", "--worker", "numpy", "--max-tokens", "7",
            "--prompts-file", str(file), "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1, captured.out  # one object, one line
    doc = json.loads(captured.out)
    assert [r["index"] for r in doc["results"]] == [0, 1, 2]
    assert [tuple(r["tokens"]) for r in doc["results"]] == alone[:3]
    assert {r["outcome"] for r in doc["results"]} == {"completed"}
    assert (doc["prompts"], doc["completed"], doc["faulted"]) == (3, 3, 0)
    assert "error" not in doc
    assert "prompt 2 (line 5): completed, " in captured.err

    real = prompts_file.generate_batch

    def second_faults(*args: object, **kwargs: object) -> object:
        for index, result in real(*args, **kwargs):  # type: ignore[arg-type]
            faulted = attrs.evolve(result, outcome="faulted", fault="stage 1: boom")
            yield index, faulted if index == 1 else result

    monkeypatch.setattr(prompts_file, "generate_batch", second_faults)
    assert cli.main(argv) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["prompts"], doc["completed"], doc["faulted"]) == (3, 2, 1)
    assert doc["results"][1]["fault"] == "stage 1: boom"
    assert doc["error"] == {
        "type": "RunFaulted",
        "message": "1 of 3 prompts did not complete; prompt 1: faulted: stage 1: boom",
    }


def test_the_prompts_file_takes_the_chain_options(
    tiny: str,
    tmp_path: Path,
    alone: list[tuple[int, ...]],
    chains_made: list[dict[str, object]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--encrypt-edges``, ``--placement`` and ``--max-concurrent`` reach the batch's
    chain (the first two were once dropped without a word), and its runs still give
    each prompt's tokens alone."""
    from runtime_cupy.cli.main import main

    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS[:2]))
    code = main(["--model", tiny, "--stages", "2", "--worker", "numpy", "--max-tokens", "7",
                 "--edges", "tcp", "--encrypt-edges", "--placement", "memory",
                 "--max-concurrent", "3", "--prompts-file", str(file)])  # fmt: skip
    assert code == 0
    assert [
        (m["edges"], m["encrypt_edges"], m["placement"], m["max_concurrent"]) for m in chains_made
    ] == [("tcp", True, "memory", 3)]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {line["index"]: tuple(line["tokens"]) for line in lines} == {0: alone[0], 1: alone[1]}


def test_a_batch_the_host_cannot_hold_at_once_runs_fewer_at_a_time(
    tiny: str,
    alone: list[tuple[int, ...]],
    chains_made: list[dict[str, object]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By default a batch puts every prompt in flight, up to ``DEFAULT_BATCH_RUNS``, but
    never more runs than the host's memory holds the caches of: on a host (its memory
    given through the host port) that holds 4 such runs, 10 prompts go 2 at a time
    (10 and 5 refused by the planner before any process started), and every prompt
    still gives its tokens alone. It once planned all of them at once, and a file of
    many prompts was refused whole."""
    import attrs

    from runtime_cupy import batch
    from runtime_cupy.serve import chain as chain_module

    real = chain_module.place_stages

    def memory(size: int) -> object:  # this host's stages' nodes, each of `size` bytes
        def place(*args: object) -> object:
            nodes, devices = real(*args)  # type: ignore[arg-type]
            return tuple(attrs.evolve(n, memory_bytes=size) for n in nodes), devices

        return place

    def needs(runs: int) -> int:  # what the planner says `runs` runs' stages need
        with monkeypatch.context() as m:
            m.setattr(chain_module, "place_stages", memory(1))
            with pytest.raises(batch.PlanRejected) as info:
                chain_module.WarmChain(
                    tiny, stages=2, worker="numpy", context=15, max_concurrent=runs
                )
        return int(info.value.rejection.bytes_needed)  # type: ignore[attr-defined]

    one, two = needs(1), needs(2)
    room = one + 3 * (two - one) + (two - one) // 2  # 4 runs' caches, not 5
    monkeypatch.setattr(chain_module, "place_stages", memory(room))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(10)]
    got = dict(generate_batch(tiny, prompts, stages=2, max_tokens=7, worker="numpy"))
    assert [m["max_concurrent"] for m in chains_made] == [10, 5, 2]
    assert {i: r.tokens for i, r in got.items()} == {i: alone[i % len(PROMPTS)] for i in range(10)}
    with pytest.raises(batch.PlanRejected):  # a count given is taken as it is
        generate_batch(tiny, prompts, stages=2, max_tokens=7, worker="numpy", max_concurrent=5)


def test_a_longrope_prompts_tokens_do_not_depend_on_the_prompts_beside_it(
    tmp_path: Path,
) -> None:
    """A LongRoPE model (original context 32, context 256): a prompt's tokens are the
    same alone and beside a prompt whose length takes the batch's context past 32
    (CONCURRENT_RUNS.md §3). The stages picked the long or short factors by the batch's
    context (its longest prompt and ``max_tokens``), so the longer prompt changed the
    shorter one's tokens."""
    from tests.fixtures.gguf_models import FIXTURE_SHAPES, write_model

    model = tmp_path / "phi3-longrope.gguf"
    write_model(model, attrs.evolve(FIXTURE_SHAPES["phi3-longrope"], quant="F32"))
    short = [164, 197, 316, 237, 206, 177, 182, 304, 90, 265, 218, 0]
    alone = dict(generate_batch(model, [short], max_tokens=6, worker="cpu"))[0]
    beside = dict(generate_batch(model, [short, list(range(1, 41))], max_tokens=6, worker="cpu"))
    assert alone.outcome == beside[0].outcome == "completed"
    assert beside[0].tokens == alone.tokens
