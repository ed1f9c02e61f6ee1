"""A process forked after its ``WarmChain`` started (a pre-fork server's worker, a
``multiprocessing`` fork) holds a copy of the chain: closing it, dropping it or using it
once killed the owner's stages and unlinked its links (the owner's run in flight
faulted, its chain broken). In the child every use raises ``ChainError`` naming the
owner, and ``close`` and the collection stop nothing of the owner's."""

from __future__ import annotations

import gc
import os
import threading
import warnings

import pytest

from runplan import SamplingConfig
from runtime_cupy.serve.chain import ChainError, WarmChain
from tests.support.hygiene import alive

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process


def _in_a_child(chain: WarmChain, how: str) -> str:
    """What the child said of ``how`` it touched its copy of ``chain`` (run there)."""
    said = []
    try:
        chain.generate([1, 2], max_tokens=2)
    except ChainError as exc:
        said.append(str(exc))
    try:
        chain.submit([1, 2], max_tokens=2, sampling=SamplingConfig())
    except ChainError as exc:
        said.append(str(exc))
    if how == "close":
        chain.close()
    else:  # dropped: its finalizer
        del chain
        gc.collect()
        for thread in threading.enumerate():
            if thread.name == "chain-dropped":
                thread.join()
    return "\n".join(said)


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_forked_copy_of_a_chain_stops_nothing_of_its_owner(tiny: str, how: str) -> None:
    chain = WarmChain(tiny, stages=2, context=64, max_concurrent=1)
    chain.start()
    try:
        pids = chain.pids()
        read, write = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # a threaded process forks
            child = os.fork()
        if child == 0:  # pragma: no cover (the child's coverage is not gathered)
            code = 1
            try:
                os.close(read)
                os.write(write, _in_a_child(chain, how).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as said:
            words = said.read()
        assert os.waitpid(child, 0)[1] == 0
        assert words.count(f"a fork of process {os.getpid()}, whose chain this is") == 2
        assert all(alive(pid) for pid in pids)
        result = chain.generate([1, 2], max_tokens=4)
        assert result.result.outcome == "completed" and result.restarted == ()
        assert chain.pids() == pids
    finally:
        chain.close()
