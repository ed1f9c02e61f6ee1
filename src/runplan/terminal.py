"""What the command lines of every package print with rich: text that users and files
give (node ids, run ids, devices, paths, model names, messages naming them) is shown as
it is, never read as rich markup (``[bold]``, ``[/]``) or emoji codes (``:smile:``)."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text


def plain_console(*, stderr: bool = False, soft_wrap: bool = False) -> Console:
    """A console whose strings (table cells and titles among them) print literally."""
    return Console(stderr=stderr, soft_wrap=soft_wrap, markup=False, emoji=False)


def labelled(label: str, style: str, text: str) -> Text:
    """``label`` in ``style``, a space, then ``text`` as it is."""
    return Text.assemble((label, style), " ", text)
