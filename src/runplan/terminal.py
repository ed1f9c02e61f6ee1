"""What the command lines of every package print with rich: text that users and files
give (node ids, run ids, devices, paths, model names, messages naming them) is shown as
it is, never read as rich markup (``[bold]``, ``[/]``) or emoji codes (``:smile:``); a
reader of standard output gone away ends the command as any write's does, one of
standard error only silences it (``CommandConsole``)."""

from __future__ import annotations

import errno
import os

from rich.console import Console
from rich.text import Text

# The width of a console writing to a file or a pipe: rich takes 80 columns where it
# cannot ask a terminal, and cuts a table's cells to fit them ("stage-0-a-lo…"), which a
# file or a script reading the table must get whole.
UNBOUNDED_COLUMNS = 1 << 16


class CommandConsole(Console):
    """rich's console for a command line: where the reader of standard output went away
    (``| head``, a pager quit) it raises ``BrokenPipeError``, which the command's
    ``__main__`` ends as a shell reports SIGPIPE (141, ``runplan.command_main``); rich's
    own raised ``SystemExit(1)``, so a command printing a table exited 1. Where the
    reader of standard error went away, the console goes quiet and the command goes on:
    its result (``--json``'s object on standard output) and its exit status are what
    they would have been (a run's ``error: run faulted`` line made it 141, the
    object printed or not)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more from this console
        if not self.stderr:
            raise BrokenPipeError(errno.EPIPE, "the reader of the output went away")


def plain_console(*, stderr: bool = False, soft_wrap: bool = False) -> Console:
    """A console whose strings (table cells and titles among them) print literally, and
    whole where it writes to a file or a pipe (a terminal's width cuts them; so does
    ``COLUMNS`` where set)."""
    console = CommandConsole(stderr=stderr, soft_wrap=soft_wrap, markup=False, emoji=False)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = UNBOUNDED_COLUMNS
    return console


def labelled(label: str, style: str, text: str) -> Text:
    """``label`` in ``style``, a space, then ``text`` as it is."""
    return Text.assemble((label, style), " ", text)
