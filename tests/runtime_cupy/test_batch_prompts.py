"""Prompts no batch can run are refused before any process starts, each named: by its
index (``generate_batch``) and, in ``--prompts-file``, by its line: none, an empty one,
a token outside the vocabulary, one too long for the context with ``max_tokens`` (these
last two once failed the whole batch with the chain's message, naming no prompt)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runplan import model_facts_from_gguf
from runtime_cupy import generate_batch
from runtime_cupy.batch import BatchError
from runtime_cupy.cli.main import main
from runtime_cupy.cli.prompts_file import PROMPT_LINE_LIMIT
from runtime_cupy.cli.stages_starting import StagesStarting


def test_no_prompt_or_an_empty_one_is_refused(tiny: str) -> None:
    with pytest.raises(BatchError, match="no prompts"):
        generate_batch(tiny, [])
    with pytest.raises(BatchError, match="prompt 1 holds no tokens") as info:
        generate_batch(tiny, [[1], []])
    assert info.value.index == 1


@pytest.mark.parametrize("ids", ["1", "1,2,3"])
def test_max_tokens_below_one_is_named_whatever_the_prompt_length(
    tiny: str, ids: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A one-token prompt with --max-tokens 0 was refused naming max_seq_len."""
    assert main(["--model", tiny, "--prompt-ids", ids, "--max-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "max_tokens = 0" in err and "max_seq_len" not in err, err


def test_a_token_outside_the_vocabulary_is_refused_naming_its_prompt(tiny: str) -> None:
    vocab = model_facts_from_gguf(tiny).vocab_size
    with pytest.raises(BatchError, match=rf"prompt 2: token 1 is {vocab}, outside") as info:
        generate_batch(tiny, [[1], [2, 3], [4, vocab]])
    assert info.value.index == 2


@pytest.mark.parametrize("bad", [5.9, "5", None, True, np.bool_(False)])
def test_a_token_that_is_no_integer_is_refused_naming_its_prompt(
    tiny: str, bad: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``int(5.9)`` once ran the prompt [5, ...] and reported it completed; a string
    raised a bare ``TypeError`` naming no prompt; ``True`` passed the check and failed
    the batch once its chain had started, naming no prompt."""
    from runtime_cupy.serve.chain import WarmChain

    def no_chain(*args: object, **kwargs: object) -> None:
        raise AssertionError("a chain started")

    monkeypatch.setattr(WarmChain, "__init__", no_chain)
    with pytest.raises(BatchError, match=rf"prompt 1: token 1 is {bad!r}, not a token id"):
        generate_batch(tiny, [[1], [2, bad]])  # type: ignore[list-item]


@pytest.mark.parametrize("bad", [True, 1.0])
def test_generate_refuses_a_token_that_is_no_token_id(tiny: str, bad: object) -> None:
    """``True`` ran as token 1, before any process starts as after."""
    from runtime_cupy import generate

    with pytest.raises(TypeError) as info:
        generate(tiny, [bad, 2], max_tokens=2)
    assert str(info.value) == f"prompt token 0 is {bad!r}, not a token id"


@pytest.mark.process
def test_a_warm_chain_refuses_a_token_that_is_no_integer(tiny: str) -> None:
    from runtime_cupy.serve.chain import WarmChain

    with WarmChain(tiny, stages=1, context=32, max_concurrent=1) as chain:
        with pytest.raises(TypeError, match=r"prompt token 0 is 5\.9, not a token id"):
            chain.generate([5.9, 17.7, 3.2], max_tokens=2)  # type: ignore[list-item]
        assert chain.generate([5, 17, 3], max_tokens=2).result.tokens  # still serving


def test_a_prompt_too_long_for_the_context_is_refused_naming_it(tiny: str) -> None:
    context = model_facts_from_gguf(tiny).context_length
    prompts = [[1, 2], [3] * (context - 2), [4]]  # context - 2 + 4 - 1 positions
    with pytest.raises(BatchError, match="prompt 1 holds") as info:
        generate_batch(tiny, prompts, max_tokens=4)
    assert info.value.index == 1 and f"context length {context}" in str(info.value)


@pytest.mark.parametrize(
    ("lines", "needle"),
    [
        (['{"prompt_ids": [1]}', "", "", '{"prompt_ids": [1, 99999]}'], "line 4: prompt 1"),
        (['{"prompt_ids": [1]}', "", '{"prompt_ids": []}'], "line 3: prompt 1 holds no"),
        # nested past the decoder's recursion: a RecursionError traceback before
        (['{"prompt_ids": [1]}', "[" * 100_000 + "]" * 100_000], "line 2: not JSON"),
    ],
)
def test_the_prompts_file_names_the_line_of_a_prompt_no_batch_can_run(
    tiny: str, tmp_path: Path, lines: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "prompts.jsonl"
    file.write_text("\n".join(lines) + "\n")
    argv = ["--model", tiny, "--prompts-file", str(file), "--max-tokens", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


def test_chat_refuses_a_prompts_file_line_of_token_ids(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--chat`` wraps the file's text lines in the chat template; a line of ids ran
    unwrapped without a word (``--chat --prompt-ids`` is refused): refused, naming it."""
    file = tmp_path / "prompts.jsonl"
    file.write_text('\n{"prompt_ids": [1, 2, 3]}\n{"prompt": "Hi"}\n')
    argv = ["--model", tiny, "--prompts-file", str(file), "--max-tokens", "2", "--chat"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--prompts-file '{file}' line 2: --chat wraps a text prompt" in err, err
    assert "Traceback" not in err, err


def test_the_prompts_file_is_read_within_bounds(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``/dev/zero`` (read whole before: a ``MemoryError`` traceback) is refused at the
    line bound, and a folder, each naming the file, exit 2."""
    for path, needle in (
        ("/dev/zero", f"line 1 is longer than {PROMPT_LINE_LIMIT} bytes"),
        (str(tmp_path), "it is a folder, not a file"),
    ):
        assert main(["--model", tiny, "--prompts-file", path, "--max-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert f"--prompts-file '{path}': {needle}" in err and "Traceback" not in err, err


@pytest.mark.process
def test_prompts_may_come_as_any_iterable_of_token_sequences(tiny: str) -> None:
    """A generator of prompts was used up by the checks ("max() arg is an empty
    sequence"), a 2-D array failed "the truth value of an array ... is ambiguous"."""
    rows = [[5, 77, 30], [3, 4, 9]]
    alone = dict(generate_batch(tiny, rows, max_tokens=3))
    for prompts in ((list(r) for r in rows), np.array(rows, dtype=np.int64)):
        got = dict(generate_batch(tiny, prompts, max_tokens=3))
        assert {i: r.tokens for i, r in got.items()} == {i: r.tokens for i, r in alone.items()}


@pytest.mark.process
def test_a_batch_shows_its_stages_start_as_one_run_does(
    tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--prompts-file`` showed nothing on standard error until its first result:
    ``generate_batch`` took no ``on_load`` (nor ``on_slice``). Each stage bound is seen
    once, as the chain starts, and the command hands the batch the display's own."""
    from runtime_cupy.cli import prompts_file

    seen: list[int] = []
    done = dict(
        generate_batch(
            tiny, [[1, 2], [3]], stages=2, max_tokens=2,
            on_load=lambda stage, _d, _t: seen.append(stage), on_slice=lambda _t: None,
        )
    )  # fmt: skip
    assert sorted(seen) == [0, 1] and sorted(done) == [0, 1]
    handed: dict[str, Any] = {}

    def batch(*args: object, **kwargs: Any) -> Any:
        handed.update(kwargs)
        return generate_batch(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(prompts_file, "generate_batch", batch)
    file = tmp_path / "prompts.jsonl"
    file.write_text('{"prompt_ids": [1, 2]}\n')
    assert main(["--model", tiny, "--prompts-file", str(file), "--max-tokens", "2"]) == 0
    assert getattr(handed["on_load"], "__func__", None) is StagesStarting.on_load
    assert getattr(handed["on_slice"], "__func__", None) is StagesStarting.on_slice


@pytest.mark.parametrize(
    ("prompts", "message"),
    [(5, "prompts must be an iterable of prompts, not int"),
     ([[1, 2], 7], "prompt 1 is 7, not a sequence of token ids")],
)  # fmt: skip
def test_prompts_that_are_no_iterable_of_sequences_are_refused_naming_them(
    tiny: str, prompts: object, message: str
) -> None:
    with pytest.raises(BatchError) as info:
        generate_batch(tiny, prompts)  # type: ignore[arg-type]
    assert str(info.value) == message
