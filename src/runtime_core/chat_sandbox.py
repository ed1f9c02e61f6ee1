"""The sandbox a chat template renders in: Jinja2's immutable sandbox, with what a
template asks to make bounded before it is made.

A template is a file's, so possibly a stranger's, and one call can ask for any amount
of memory: ``'x'.ljust(3000000000)``, ``'{:>3000000000}'.format('x')``,
``'%*s' % (3000000000, 'x')``, ``'x'|center(3000000000)``, ``s|replace('a', s)`` and
``s ~ s`` doubled in a loop. So each operation that can make more than it is given
(``*``, ``+``, ``~``, ``%``, the padding, replacing, splitting, joining and formatting
methods of ``str``, the filters ``center``, ``indent``, ``wordwrap``, ``replace``, ``join``,
``format``, ``batch`` and ``slice``, and ``lipsum``) is refused, before it runs, when
what it would make passes ``MAX_RENDER_CHARS``; every call's and filter's result past it
is refused too; and a filter or call given an iterator (``range(N)|map(...)``) stops
drawing from it once what it drew passes it. ``**`` and ``*`` on integers are bounded
to ``MAX_EXPONENT_BITS`` bits.

Sizes are counted by ``size``: the characters of a string (or bytes), an integer's
decimal digits, through lists, tuples and dicts, each item as ``ITEM_CHARS`` more.
A value a template prints (``{{ x }}``) and each piece of a ``~`` is counted before it
is made into text; the filters that make a list of a string's characters (``list``,
``sort``, ``unique``, ``batch``, ``slice``) count its characters as items.
"""

from __future__ import annotations

import re
import string
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import wraps
from typing import Any, NoReturn

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum

from runtime_core.tokenizer_vocab import TokenizerError


class ChatTemplateError(TokenizerError):
    """The chat template failed: a syntax error, an error while rendering, the
    template's own ``raise_exception(message)``, or something it asked to make past
    its bounds."""


#: The most text a template makes: its output, and each value on the way.
MAX_RENDER_CHARS = 32 << 20
#: The largest integer a template computes (``2 ** 4096`` and below).
MAX_EXPONENT_BITS = 4096

#: What an item of a list, tuple or dict counts for, in characters: about the memory it
#: takes (a reference and a small object), and few enough that counting is quick.
ITEM_CHARS = 16

#: A ``%`` conversion: its width and precision (digits or ``*``).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def size(value: Any) -> int:
    """The characters in ``value``, counted through lists, tuples and dicts (each item
    as ``ITEM_CHARS`` more); the count stops soon past ``MAX_RENDER_CHARS``."""
    total = 0
    stack = [value]
    while stack and total <= MAX_RENDER_CHARS:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, int):  # its decimal digits (and a sign)
            total += item.bit_length() * 3 // 10 + 2
        elif isinstance(item, (list, tuple)):
            total += ITEM_CHARS * len(item)
            if total <= MAX_RENDER_CHARS:
                stack.extend(item)
        elif isinstance(item, dict):
            total += ITEM_CHARS * 2 * len(item)
            if total <= MAX_RENDER_CHARS:
                stack.extend(item.keys())
                stack.extend(item.values())
    return total


def _refuse(what: str, chars: int) -> NoReturn:
    raise ChatTemplateError(
        f"the chat template asks for {what}: {chars} characters, more than {MAX_RENDER_CHARS}"
    )


def _bound(what: str, chars: int) -> None:
    if chars > MAX_RENDER_CHARS:
        _refuse(what, chars)


def _checked(what: str, result: Any) -> Any:
    _bound(what, size(result))
    return result


def _drawn(items: Iterator[Any], what: str) -> Iterator[Any]:
    """``items``, ended with a refusal once what was drawn passes ``MAX_RENDER_CHARS``."""
    total = 0
    for item in items:
        total += ITEM_CHARS + size(item)
        _bound(what, total)
        yield item


def _bounded_iterators(args: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    return tuple(
        _drawn(a, what) if isinstance(a, Iterator) and not isinstance(a, (str, bytes)) else a
        for a in args
    )


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _replaced(s: Any, old: Any, new: Any, count: Any) -> int:
    """The most characters ``s.replace(old, new, count)`` makes (a ``str`` subclass's,
    such as markupsafe's ``Markup``, which escapes ``new``: each of its characters as up
    to 6)."""
    kind: Any = str if isinstance(s, str) else bytes
    if not isinstance(old, kind) or not isinstance(new, kind):
        return len(s)
    times: int = kind.count(s, old) if old else len(s) + 1
    if _int(count) >= 0 and count is not None:
        times = min(times, count)
    grown = len(new) * (1 if type(s) in (str, bytes) else 6)
    return len(s) + times * max(0, grown - len(old))


def _format_chars(fmt: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """The most characters ``fmt.format(*args, **kwargs)`` makes: each field as long as
    its width or precision, or all the arguments together (and a width given by an
    argument as large as the largest integer argument)."""
    values = (*args, *kwargs.values())
    largest = max((abs(_int(v)) for v in values), default=0)
    chars = 0
    for literal, field, spec, _ in string.Formatter().parse(fmt):
        chars += len(literal)
        if field is None:
            continue
        widths = sum(int(digits) for digits in re.findall(r"\d+", spec or ""))
        if "{" in (spec or ""):
            widths += 2 * largest
        chars += widths + size(values)
    return chars


def _percent_chars(fmt: str, values: Any) -> int:
    """The most characters ``fmt % values`` makes: the widths and precisions of its
    conversions (one given by ``*`` as large as the largest integer value), and its
    values, once each in a tuple, once per conversion in a mapping."""
    specs = _PERCENT_SPEC.findall(fmt)
    given = values if isinstance(values, tuple) else (values,)
    largest = max((abs(_int(v)) for v in given), default=0)
    widths = sum(largest if part == "*" else int(part or 0) for spec in specs for part in spec)
    times = len(specs) if isinstance(values, Mapping) else 1
    return len(fmt) + widths + times * size(values)


def _str_method_chars(method: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """The most characters a ``str`` (or ``bytes``) method makes, for those that can make
    more than they are given; 0 for the others."""
    s = method.__self__
    name = method.__name__
    first = args[0] if args else None
    if name in ("ljust", "rjust", "center", "zfill"):
        return max(len(s), _int(first))
    if name == "expandtabs":
        tab = _int(first if args else kwargs.get("tabsize", 8))
        tabs: int = s.count("\t" if isinstance(s, str) else b"\t")
        return len(s) + tabs * max(tab, 0)
    if name == "replace" and len(args) >= 2:
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        return _replaced(s, args[0], args[1], count)
    if name in ("split", "rsplit"):  # each piece a new string: counted as an item
        sep = first if args else kwargs.get("sep")
        pieces = s.count(sep) + 1 if isinstance(sep, type(s)) and sep else (len(s) + 1) // 2
        return len(s) + ITEM_CHARS * pieces
    if name == "translate" and isinstance(first, Mapping):
        longest = max((size(v) for v in first.values()), default=1)
        return len(s) * max(1, longest)
    return 0


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja2's code generator with ``~`` joined by ``environment.join_bounded``."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.join_bounded((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _bounded_filter(
    name: str, func: Callable[..., Any], before: Callable[..., int] | None
) -> Callable[..., Any]:
    """``func`` (the filter ``name``), refused when ``before`` (given the filter's own
    arguments) says it would make too much, or when what it made is too much."""
    passed = 1 if hasattr(func, "jinja_pass_arg") else 0
    what = f"the filter {name}"

    @wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        args = _bounded_iterators(args, what)
        if name == "join" and len(args) > passed and isinstance(args[passed], Iterator):
            args = (*args[:passed], list(args[passed]), *args[passed + 1 :])
        if before is not None:
            _bound(what, before(*args[passed:], **kwargs))
        return _checked(what, func(*args, **kwargs))

    return bounded


def _joined_chars(value: Any, d: Any = "", attribute: Any = None) -> int:
    joined = size(value)
    if isinstance(value, (list, tuple)):
        joined += max(0, len(value) - 1) * len(str(d))
    return joined


def _indented_chars(s: Any, width: Any = 4, *_: Any, **__: Any) -> int:
    text = str(s)
    step = len(width) if isinstance(width, str) else _int(width)
    return len(text) + (text.count("\n") + 1) * step


def _wrapped_chars(
    s: Any, width: Any = 79, long_words: Any = True, wrapstring: Any = None, **_: Any
) -> int:
    wrap = wrapstring
    return len(str(s)) * (1 + len(wrap)) if isinstance(wrap, str) and len(wrap) > 1 else 0


def _items_chars(value: Any, *_: Any, **__: Any) -> int:
    """A string made a list of its characters: each an item (``ITEM_CHARS``)."""
    return ITEM_CHARS * len(value) if isinstance(value, (str, bytes)) else 0


def _grouped_chars(value: Any, count: Any, fill_with: Any = None) -> int:
    return _items_chars(value) + _int(count) * (1 + size(fill_with))


#: The filters that can make more than they are given: how much, from their arguments.
_FILTER_CHARS: dict[str, Callable[..., int]] = {
    "center": lambda value, width=80: max(len(str(value)), _int(width)),
    "indent": _indented_chars,
    "wordwrap": _wrapped_chars,
    "replace": lambda s, old, new, count=None: _replaced(str(s), str(old), str(new), count),
    "join": _joined_chars,
    "format": lambda value, *args, **kwargs: _percent_chars(str(value), kwargs or args),
    "batch": _grouped_chars,
    "slice": _grouped_chars,
    "list": _items_chars,
    "sort": _items_chars,
    "unique": _items_chars,
}


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    _bound("lipsum", _int(n) * _int(max) * 16)
    return generate_lorem_ipsum(n, html, min, max)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with what a template asks to make bounded before it is
    made (the module's docstring says which operations)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, finalize=self.printed, **kwargs)
        self.globals["lipsum"] = _lipsum

    def bound_filters(self) -> None:
        """Wrap every filter now in ``filters`` (call after adding the environment's own)."""
        for name, func in list(self.filters.items()):
            self.filters[name] = _bounded_filter(name, func, _FILTER_CHARS.get(name))

    def join_bounded(self, values: Iterable[Any]) -> str:
        """``~``: the values as strings, joined, each counted before it is made text."""
        pieces = []
        total = 0
        for value in values:
            total += size(value)
            _bound("a join with ~", total)
            pieces.append(str(value))
        _bound("a join with ~", sum(len(p) for p in pieces))
        return "".join(pieces)

    @staticmethod
    def printed(value: Any) -> Any:
        """``finalize``: what a template prints, counted before it is made text."""
        _bound("printing a value", size(value))
        return value

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            self._check_repeat(left, right)
        elif operator == "**" and (
            isinstance(left, int)
            and isinstance(right, int)
            and abs(left) > 1
            and right * abs(left).bit_length() > MAX_EXPONENT_BITS
        ):
            raise ChatTemplateError(
                f"the chat template computes {left} ** {right}: past {MAX_EXPONENT_BITS} bits"
            )
        elif operator == "+" and isinstance(left, (str, bytes, list, tuple)):
            _bound("a sum with +", size(left) + size(right))
        elif operator == "%" and isinstance(left, str):
            _bound(f"the formatting {left[:40]!r} % ...", _percent_chars(left, right))
            return _checked("a formatting with %", super().call_binop(context, "%", left, right))
        return super().call_binop(context, operator, left, right)

    @staticmethod
    def _check_repeat(left: Any, right: Any) -> None:
        if _int(left) and _int(right):
            if abs(left).bit_length() + abs(right).bit_length() > MAX_EXPONENT_BITS:
                raise ChatTemplateError(
                    f"the chat template multiplies {left} by {right}: past {MAX_EXPONENT_BITS} bits"
                )
            return
        for seq, count in ((left, right), (right, left)):
            if (
                isinstance(seq, (str, bytes, list, tuple))
                and isinstance(count, int)
                and size(seq) * count > MAX_RENDER_CHARS
            ):
                raise ChatTemplateError(
                    f"the chat template repeats a sequence of {len(seq)} {count} times: "
                    f"more than {MAX_RENDER_CHARS}"
                )

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        what = f"the call {getattr(__obj, '__name__', type(__obj).__name__)}"
        # a str's or bytes' method, its subclasses' too (markupsafe's Markup, which
        # |safe and |e make, has Python methods of its own)
        if isinstance(__obj, (types.BuiltinMethodType, types.MethodType)) and isinstance(
            getattr(__obj, "__self__", None), (str, bytes)
        ):
            what = f"{__obj.__self__[:40]!r}.{__obj.__name__}(...)"  # type: ignore[index]
            if __obj.__name__ == "join" and args:
                if not isinstance(args[0], (list, tuple)):
                    args = (list(_drawn(iter(args[0]), what)), *args[1:])
                _bound(what, _joined_chars(args[0], __obj.__self__))
            _bound(what, _str_method_chars(__obj, args, kwargs))
        args = _bounded_iterators(args, what)
        return _checked(what, super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__
        what = f"{fmt[:40]!r}.{value.__name__}(...)"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if value.__name__ == "format_map" and args and isinstance(args[0], Mapping):
                _bound(what, _format_chars(fmt, (), args[0]))
            else:
                _bound(what, _format_chars(fmt, args, kwargs))
            made: str = _checked(what, wrapped(*args, **kwargs))
            return made

        return bounded
