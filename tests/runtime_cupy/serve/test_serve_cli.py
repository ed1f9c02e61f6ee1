"""``python -m runtime_cupy serve`` checks every option before anything starts: a bad
one is one line naming it and its value, exit status 2, and nothing listens or runs
(``main`` is called here as the command line calls it, in this process: it returns or
exits before it would start a stage). The API key never comes from the command line,
and an empty one is refused."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from runtime_cupy.cli import serve as cli
from runtime_cupy.cli.serve import (
    API_KEY_VARIABLE,
    KEY_LINE_LIMIT,
    KeyRefused,
    api_key_from,
    build_parser,
    main,
)


class WouldListen(AssertionError):
    pass


@pytest.fixture(autouse=True)
def never_listen(monkeypatch: pytest.MonkeyPatch) -> None:
    """An option that is not refused reaches the listening socket: the test fails there
    at once, with nothing started, instead of serving forever."""

    def listen(host: str, port: int) -> None:
        raise WouldListen(f"the server would listen on {host}:{port}")

    monkeypatch.setattr(cli, "_listen", listen)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # the parser's own errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--port", "-1"], "--port: -1 is not a port"),
        (["--port", "99999"], "--port: 99999 is not a port"),
        (["--port", "http"], "--port: 'http' is not a port number"),
        (["--log-dir", "/nonexistent/x"], "--log-dir: '/nonexistent/x' is not a folder"),
        (["--gpus", "0"], "--gpus: 0 names GPUs, but the cpu worker runs on the CPU"),
        (["--max-queue", "-1"], "--max-queue: '-1' is negative"),
        (["--client-timeout", "0"], "--client-timeout: '0' is not a positive number"),
        (["--max-connections", "0"], "--max-connections: '0' is not a positive integer"),
        (["--api-key", "s3cret-key"], "--api-key is refused"),
    ],
)
def test_a_bad_option_is_one_line_naming_it_and_nothing_starts(
    tiny_chat: str, extra: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run(["--model", tiny_chat, "--port", "0", *extra], capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert words in err, err
    assert "Traceback" not in err and "listening" not in err
    assert "s3cret-key" not in err  # a key is never echoed


def test_a_log_dir_that_is_a_file_or_not_writable_is_refused(
    tiny_chat: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("x")
    code, err = _run(["--model", tiny_chat, "--log-dir", str(afile)], capsys)
    assert code == 2 and f"'{afile}' is not a folder" in err, err


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["--model", "m", *argv])


def test_the_key_comes_from_the_environment_or_a_file_never_empty(tmp_path: Path) -> None:
    assert api_key_from(_args(), {}) is None  # no key: none asked for
    assert api_key_from(_args(), {API_KEY_VARIABLE: "k-1"}) == "k-1"
    keyfile = tmp_path / "key"
    keyfile.write_text("k-2\n")
    assert api_key_from(_args("--api-key-file", str(keyfile)), {}) == "k-2"
    refusals = [
        (_args(), {API_KEY_VARIABLE: ""}, f"{API_KEY_VARIABLE}: the key is empty"),
        (_args(), {API_KEY_VARIABLE: "  "}, f"{API_KEY_VARIABLE}: the key is empty"),
        (_args(), {API_KEY_VARIABLE: "a b"}, "which a Bearer token cannot carry"),
        (_args(), {API_KEY_VARIABLE: "k\u00e9y"}, "which a Bearer token cannot carry"),
        (_args("--api-key", "k-3"), {}, "visible to every user of this machine (ps)"),
        (
            _args("--api-key-file", str(keyfile)),
            {API_KEY_VARIABLE: "k-1"},
            "give one",
        ),
        (_args("--api-key-file", str(tmp_path / "none")), {}, "cannot read the key"),
    ]
    empty = tmp_path / "empty"
    empty.write_text("\n")
    refusals.append((_args("--api-key-file", str(empty)), {}, "the key is empty"))
    for args, environ, words in refusals:
        with pytest.raises(KeyRefused) as info:
            api_key_from(args, environ)
        assert words in str(info.value), (environ, str(info.value))
        assert "k-3" not in str(info.value)


def test_only_a_bounded_first_line_of_the_key_file_is_read(
    tiny_chat: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The key is the first line, read up to ``KEY_LINE_LIMIT`` bytes: a longer line, or
    ``/dev/zero`` (read whole before: a ``MemoryError`` traceback), is refused, exit 2;
    what follows the key's line is never read."""
    keyfile = tmp_path / "key"
    with keyfile.open("wb") as f:
        f.write(b"k-4\n" + b"\xff" * (8 * KEY_LINE_LIMIT))  # not text, and never read
    assert api_key_from(_args("--api-key-file", str(keyfile)), {}) == "k-4"
    long = tmp_path / "long"
    long.write_text("k" * (KEY_LINE_LIMIT + 1) + "\n")
    for path in (long, Path("/dev/zero")):
        with pytest.raises(KeyRefused) as info:
            api_key_from(_args("--api-key-file", str(path)), {})
        assert f"longer than {KEY_LINE_LIMIT} bytes" in str(info.value), info.value
        code, err = _run(["--model", tiny_chat, "--api-key-file", str(path)], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"--api-key-file '{path}': cannot read the key" in err, err


def test_an_empty_key_in_the_environment_stops_the_server_before_it_starts(
    tiny_chat: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(API_KEY_VARIABLE, "")
    code, err = _run(["--model", tiny_chat, "--port", "0"], capsys)
    assert code == 2 and "the key is empty" in err and "listening" not in err, err


def test_logprobs_is_off_unless_asked_and_reaches_the_chain() -> None:
    """``--logprobs`` makes the chain's tokens carry their logits (``WarmChain.logprobs``);
    without it a request for log probabilities is refused (test_server.py)."""
    from runtime_cupy.cli.arguments import chain_from

    parser = build_parser()
    for argv, wanted in (
        (["--model", "smollm2-135m"], False),
        (["--model", "smollm2-135m", "--logprobs"], True),
    ):
        args = parser.parse_args(argv)
        assert args.logprobs is wanted
        chain = chain_from(args)  # planned, not started
        assert chain.logprobs is wanted
        assert chain.template.return_logits is wanted


def test_stage_processes_are_counted_in_words() -> None:
    """What ``runtime_cupy`` and ``chat`` say as the stages start, and a run's summary
    (it said "starting 1 stage processes")."""
    from runtime_cupy.cli.arguments import stage_processes

    assert stage_processes(1) == "1 stage process"
    assert [stage_processes(n) for n in (0, 2, 3)] == [
        "0 stage processes",
        "2 stage processes",
        "3 stage processes",
    ]


def test_the_help_counts_runs_not_requests() -> None:
    """--max-queue and --max-concurrent count choices (a request of ``n`` is ``n`` runs):
    the help said "requests", and a request of n=5 beside one running one got 429 from a
    --max-queue 3 server with no request waiting."""
    text = " ".join(build_parser().format_help().split())
    assert "--max-concurrent requests" not in text
    assert "requests that may wait" not in text
    assert "a request's n choices are n runs" in text
    assert "runs that may wait while --max-concurrent run" in text


def test_the_help_names_what_the_key_and_the_queue_leave_out() -> None:
    """``/health`` needs no key, and an idle server admits a request of any ``n`` (else
    one of more choices than --max-queue could never be): the help said "the Bearer
    token every request must carry" and "a request that would make more wait gets 429"."""
    text = " ".join(build_parser().format_help().split())
    assert "the Bearer token every request but GET /health must carry" in text
    assert "a request that would make more wait gets 429, unless none runs or waits" in text
