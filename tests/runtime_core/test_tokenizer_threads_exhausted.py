"""The tokenizer on a host out of threads (a control group's ``pids.max``, ``ulimit -u``,
``threads-max``): the ``tokenizers`` library's Rust thread pool, on which
``encode_batch`` merges, cannot be built, and ``encode`` merges the text instead, into
the same ids (``runtime_core.tokenizer_merge``). It was a ``PanicException`` traceback
with a Rust backtrace, and a command line given a text prompt exited 1 with no JSON
(``tests/runtime_cupy/test_threads_exhausted.py`` runs that one).

Threads are capped by a ``pids`` control group (``tests.support.pids_cgroup``): root is
not held to ``RLIMIT_NPROC``. Needs root; skipped with the reason elsewhere."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

import pytest

from runtime_core import tokenizer_merge
from runtime_core.tokenizer import Tokenizer
from runtime_core.tokenizer_merge import merged_ids
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.runtime_cupy.test_process_cli import _env
from tests.support.pids_cgroup import no_pids_cgroup, pids_cgroup

TEXTS = ["hello world, a text", "and another one", "<s> more"]
#: One thread per process wherever a library would start a pool of them, but the
#: tokenizers library's own (``TOKENIZERS_PARALLELISM`` unset: its pool is tried).
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "RAYON_NUM_THREADS": "1"}  # fmt: skip
ENCODE = """
import json, sys
from runtime_core.tokenizer import Tokenizer
tokenizer = Tokenizer.from_gguf(sys.argv[1])
print(json.dumps([tokenizer.encode(text) for text in json.loads(sys.argv[2])]))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_model(tmp_path_factory.mktemp("merge") / "tiny.gguf", ModelShape()))


def test_a_text_is_merged_without_the_thread_pool_a_host_cannot_start(tiny: str) -> None:
    """A process alone in a group of one task (its main thread): the library's pool is
    refused, and each text still comes out as its ids."""
    reason = no_pids_cgroup()
    if reason is not None:
        pytest.skip(reason)
    env = {**_env(), **ONE_THREAD}
    env.pop("TOKENIZERS_PARALLELISM", None)
    argv = [sys.executable, "-c", ENCODE, tiny, json.dumps(TEXTS)]
    with pids_cgroup(1) as (_, join):
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=env, preexec_fn=join, timeout=120,
            check=False,
        )  # fmt: skip
    assert "thread pool" in proc.stderr, proc.stderr[-3000:]  # the pool was refused
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    tokenizer = Tokenizer.from_gguf(tiny)
    assert json.loads(proc.stdout) == [tokenizer.encode(text) for text in TEXTS]


class _Encoding:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class _PoolRefused(BaseException):
    """What pyo3 raises for the library's panic: a ``BaseException`` of its own module."""


_PoolRefused.__name__ = "PanicException"
_PoolRefused.__module__ = "pyo3_runtime"


class _NoPool:
    """A library whose thread pool cannot be built: ``encode_batch`` panics with
    ``raised``, and ``encode`` merges each character to its code point."""

    def __init__(self, raised: BaseException) -> None:
        self.raised = raised
        self.batches = 0

    def encode_batch(self, input: list[str], *, add_special_tokens: bool) -> Sequence[_Encoding]:
        self.batches += 1
        raise self.raised

    def encode(self, sequence: str, *, add_special_tokens: bool) -> _Encoding:
        return _Encoding([ord(c) for c in sequence])


POOL_PANIC = (
    "The global thread pool has not been initialized.: ThreadPoolBuildError { kind: "
    'IOError(Os { code: 11, kind: WouldBlock, message: "Resource temporarily unavailable" }) }'
)


def test_once_the_pool_is_refused_each_fragment_is_merged_by_encode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rayon builds its pool once: refused, it is not tried again in the process."""
    monkeypatch.setattr(tokenizer_merge, "_POOL", tokenizer_merge._Pool())
    library = _NoPool(_PoolRefused(POOL_PANIC))
    assert merged_ids(library, "ab") == [97, 98]
    assert merged_ids(library, "c") == [99]
    assert library.batches == 1


@pytest.mark.parametrize(
    "raised",
    [_PoolRefused("called `Option::unwrap()` on a `None` value"), KeyboardInterrupt()],
    ids=["another panic", "Ctrl-C"],
)
def test_what_is_not_the_pool_refused_is_raised(
    raised: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer_merge, "_POOL", tokenizer_merge._Pool())
    library = _NoPool(raised)
    with pytest.raises(type(raised)):
        merged_ids(library, "ab")
    assert not tokenizer_merge._POOL.missing
