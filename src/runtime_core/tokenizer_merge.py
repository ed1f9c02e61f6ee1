"""One fragment of text merged into token ids by the ``tokenizers`` library, also on a
host out of threads.

``encode_batch`` lets go of the interpreter while it merges (``encode`` holds it): a long
text tokenized in a thread does not stop the others. It merges on the library's Rust
thread pool (rayon's global pool), built at its first use; where the host has no thread
left for it (``ulimit -u``, a control group's ``pids.max``, ``threads-max``: ``EAGAIN``)
the library panics (``pyo3_runtime.PanicException: The global thread pool has not been
initialized``), and so does every call after it in the process (rayon builds its pool
once). Then the fragment is merged with ``encode``, one text and no pool, into the same
ids, and so is every fragment after it in this process. Rust's panic hook has written
its message (with a backtrace under ``RUST_BACKTRACE``) on standard error by then, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Encoding(Protocol):
    @property
    def ids(self) -> list[int]: ...


class MergingTokenizer(Protocol):
    """What of a ``tokenizers.Tokenizer`` merging a fragment takes."""

    def encode_batch(
        self, input: list[str], *, add_special_tokens: bool
    ) -> Sequence[_Encoding]: ...

    def encode(self, sequence: str, *, add_special_tokens: bool) -> _Encoding: ...


class _Pool:
    """Whether the library's thread pool could not be built in this process."""

    def __init__(self) -> None:
        self.missing = False


_POOL = _Pool()


def pool_not_built(exc: BaseException) -> bool:
    """Whether ``exc`` is the ``tokenizers`` library's panic at a Rust thread pool that
    could not be built (pyo3's ``PanicException``, a ``BaseException``)."""
    kind = type(exc)
    panic = kind.__name__ == "PanicException" and kind.__module__ == "pyo3_runtime"
    return panic and "thread pool" in str(exc)


def merged_ids(hf: MergingTokenizer, fragment: str) -> list[int]:
    """The ids ``hf`` merges ``fragment`` into (no special tokens added): with
    ``encode_batch``, or with ``encode`` once the library's thread pool could not be
    built in this process."""
    if not _POOL.missing:
        try:
            return list(hf.encode_batch([fragment], add_special_tokens=False)[0].ids)
        except BaseException as exc:
            if not pool_not_built(exc):
                raise
            _POOL.missing = True
    return list(hf.encode(fragment, add_special_tokens=False).ids)
