"""What the command lines of every package share: a parser whose errors are one line,
and argument types that name the bad value."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from fractions import Fraction
from importlib import metadata
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

from runplan.json_errors import USAGE_ERROR, error_json, print_json
from runplan.pool import NodeSpec


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line on standard error
    (naming the argument and its bad value) and exit status 2, without the usage
    block; ``--help`` still shows it. A command line that takes ``--json`` and gives
    it (``asks_for_json``: an abbreviation too, and to a subcommand, whichever parser
    reports the error: an unknown flag is the top parser's) gets the error object on
    standard output as well (``runplan.json_errors``, type ``UsageError``): standard
    output is one JSON object whatever went wrong."""

    _wants_json = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        given = sys.argv[1:] if args is None else list(args)
        self._wants_json = any(asks_for_json(p, given) for p in _parsers(self))
        return super().parse_known_args(given, namespace)

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        """``--help``'s and ``--version``'s text, its write's error raised (argparse
        drops an ``OSError``: ``--version > /dev/full`` exited 0, its text lost) for the
        package's ``__main__`` (``runplan.command_main``) to report."""
        if message:
            (file or sys.stderr).write(message)

    def error(self, message: str) -> NoReturn:
        line = f"{self.prog}: error: {message} (see {self.prog} --help)"
        sys.stderr.write(line + "\n")
        if self._wants_json:
            print_json(error_json(USAGE_ERROR, line))
        sys.exit(2)


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: the installed distribution's version, then exit 0."""
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s (gguf-pipeline {installed_version()})",
        help="print the installed version of gguf-pipeline and exit",
    )


def installed_version() -> str:
    """The version of the installed ``gguf-pipeline`` distribution (``unknown`` where
    the packages run from a source tree that was never installed)."""
    try:
        return metadata.version("gguf-pipeline")
    except metadata.PackageNotFoundError:
        return "unknown"


def asks_for_json(parser: argparse.ArgumentParser, given: Sequence[str]) -> bool:
    """Whether ``given`` asks ``parser`` for ``--json``: the flag itself, ``--json=...``
    or an abbreviation that ``parser`` reads as it (``--js``, where no other flag
    starts so), before any ``--`` (after it every word is an operand)."""
    if "--json" not in parser._option_string_actions:
        return False
    for word in given:
        if word == "--":
            return False
        flag = word.partition("=")[0]
        if flag == "--json" or (parser.allow_abbrev and _abbreviates_json(parser, flag)):
            return True
    return False


def _abbreviates_json(parser: argparse.ArgumentParser, flag: str) -> bool:
    """``flag`` is a prefix of ``--json`` and of no other flag of ``parser``."""
    if len(flag) <= 2 or not flag.startswith("--"):
        return False
    return {o for o in parser._option_string_actions if o.startswith(flag)} == {"--json"}


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and its subcommands' parsers, theirs too: an unknown flag given to a
    subcommand is the top parser's error to report (argparse), ``--json`` the
    subcommand's flag."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(_parsers(sub))
    return found


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer of at least 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """An ``argparse`` type: an integer of at least 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
#: digits of a size's whole part past which it is too large (a float's range, which
#: sizes were once read in: past it, no plan can count the bytes anyway)
_MAX_SIZE_DIGITS = 308


#: fractional digits of a size read: a byte count's fraction of a unit (``u = 10**a *
#: 2**b``, ``b <= 40``) ends within 40 digits, so the digits past these never move the
#: whole bytes a size holds
_SIZE_FRACTION_DIGITS = 64


def parse_size(text: str) -> int:
    """``80GiB``, ``24GB``, ``512MiB``, ``1000`` (bytes) -> the whole bytes it holds,
    counted exactly (``1.001GB`` is 1,001,000,000 bytes, ``18446744073709551615``
    itself: a float made them a byte less, and ``2**64 - 1`` ``2**64``)."""
    m = _SIZE_RE.match(text)
    unit = m[2].lower() if m else ""
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"bad size {_shown(text)}: use a number with B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
        )
    whole, _, fraction = m[1].partition(".")
    whole = whole.lstrip("0")  # leading zeros count for nothing (nor toward int's limit)
    if len(whole) > _MAX_SIZE_DIGITS:  # more digits than a float held
        raise argparse.ArgumentTypeError(
            f"size {_shown(text)} is too large: more than {_MAX_SIZE_DIGITS} digits before its unit"
        )
    digits = fraction[:_SIZE_FRACTION_DIGITS]
    value = Fraction(int(whole + digits or "0"), 10 ** len(digits)) * _UNITS[unit]
    return math.floor(value)


#: characters of a bad size an error shows: a size of thousands of digits is shown by
#: its ends (``'99999...999GiB' (5003 characters)``)
_SHOWN_CHARACTERS = 40


def _shown(text: str) -> str:
    """``text`` quoted, its middle left out where it is longer than an error can show."""
    if len(text) <= _SHOWN_CHARACTERS:
        return repr(text)
    half = _SHOWN_CHARACTERS // 2
    return f"{text[:half] + '...' + text[-half:]!r} ({len(text)} characters)"


def parse_nodes(text: str) -> tuple[NodeSpec, ...]:
    """``gpu0=80GiB,gpu1=24GiB@cuda:1`` -> node specs (``@device`` is optional; nodes
    naming one device share its memory)."""
    nodes = []
    for item in text.split(","):
        node_id, sep, rest = item.strip().partition("=")
        if not sep or not node_id:
            raise argparse.ArgumentTypeError(
                f"bad node {item!r}: write NODE=SIZE or NODE=SIZE@DEVICE, e.g. gpu0=80GiB"
            )
        size, at, device = rest.partition("@")
        if at and not device.strip():
            raise argparse.ArgumentTypeError(
                f"bad node {item!r}: no device after @: write NODE=SIZE@DEVICE, e.g. "
                "gpu1=24GiB@cuda:1, or NODE=SIZE for a node of its own"
            )
        nodes.append(NodeSpec(node_id, parse_size(size), device or None))
    return tuple(nodes)


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
