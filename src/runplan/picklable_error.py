"""``PicklableError``: an exception that crosses a process boundary as it was raised.

Python pickles an exception as its class called with ``args`` (what it gave
``BaseException.__init__``: here, mostly the message it formatted) and then its
attributes. An error whose ``__init__`` takes other arguments (a path and a message,
a run id and byte counts) cannot be rebuilt that way: unpickling raises ``TypeError``
where a Ray task, a process pool or a queue hands the error to another process, and
the caller sees an unpickling failure in place of the error. ``PicklableError``, put
first among an exception's bases, rebuilds it without calling ``__init__``: the same
class, ``args``, message and attributes.
"""

from __future__ import annotations

from typing import Any


def _rebuilt(
    cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]
) -> BaseException:
    exc = cls.__new__(cls, *args)  # BaseException.__new__ keeps args; no __init__ runs
    exc.args = args
    exc.__dict__.update(state)
    return exc


class PicklableError:
    """Mixin, the first base of an exception with its own ``__init__``: pickled by its
    class, ``args`` and attributes (``__dict__``), rebuilt from those alone."""

    def __reduce__(self) -> tuple[Any, ...]:
        assert isinstance(self, BaseException)
        return (_rebuilt, (type(self), self.args, dict(self.__dict__)))
