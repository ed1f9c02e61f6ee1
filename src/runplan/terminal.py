"""What the command lines of every package print with rich: text that users and files
give (node ids, run ids, devices, paths, model names, messages naming them) is shown as
it is, never read as rich markup (``[bold]``, ``[/]``) or emoji codes (``:smile:``)."""

from __future__ import annotations

import os

from rich.console import Console
from rich.text import Text

# The width of a console writing to a file or a pipe: rich takes 80 columns where it
# cannot ask a terminal, and cuts a table's cells to fit them ("stage-0-a-lo…"), which a
# file or a script reading the table must get whole.
UNBOUNDED_COLUMNS = 1 << 16


def plain_console(*, stderr: bool = False, soft_wrap: bool = False) -> Console:
    """A console whose strings (table cells and titles among them) print literally, and
    whole where it writes to a file or a pipe (a terminal's width cuts them; so does
    ``COLUMNS`` where set)."""
    console = Console(stderr=stderr, soft_wrap=soft_wrap, markup=False, emoji=False)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = UNBOUNDED_COLUMNS
    return console


def labelled(label: str, style: str, text: str) -> Text:
    """``label`` in ``style``, a space, then ``text`` as it is."""
    return Text.assemble((label, style), " ", text)
