"""A recovering warm chain whose model file is replaced under it (another GGUF renamed
into place) does not replay a stream on a mix of two models: the stages it would keep
hold the old file's weights, a stage started again would read the new one. The
recovery is refused, naming the file and what changed, and the run ends faulted as it
would without ``recover``; the next run starts every stage again on the file as it is,
and a stream of the old chain that comes to recover after that is refused as well.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from runtime_cupy import generate
from runtime_cupy.process.chain_run import ChainRun
from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.serve.chain_errors import SourceChanged
from tests.fixtures.gguf_models import ModelShape, write_model

pytestmark = pytest.mark.process

PROMPT = [5, 77, 30, 12, 9]
TOKENS = 12


def test_a_model_file_replaced_under_the_chain_is_not_recovered_onto(tmp_path: Path) -> None:
    path = write_model(tmp_path / "model.gguf", ModelShape(n_layers=3, seed=1))
    other = write_model(tmp_path / "other.gguf", ModelShape(n_layers=3, seed=2))
    old = generate(str(path), PROMPT, stages=1, max_tokens=TOKENS)
    new = generate(str(other), PROMPT, stages=1, max_tokens=TOKENS)
    assert old.tokens != new.tokens, "the two models answer apart"
    with WarmChain(str(path), stages=3, context=64, recover=True) as chain:
        assert chain.generate(PROMPT, max_tokens=TOKENS).result.tokens == old.tokens
        os.replace(other, path)  # a new version renamed into place
        pids = chain.pids()
        seen: list[int] = []

        def on_token(token: int) -> None:
            seen.append(token)
            if len(seen) == 3:
                os.kill(pids[1], signal.SIGKILL)

        runs: list[ChainRun] = []
        run = chain.generate(PROMPT, max_tokens=TOKENS, on_token=on_token, on_run=runs.append)
        assert run.result.outcome == "faulted", run.result.tokens
        fault = run.result.fault or ""
        assert "SIGKILL" in fault and "not recovered" in fault
        assert f"{path} changed since the chain's stages started" in fault
        assert "inode" in fault, "what changed is named"
        assert chain.recoveries.count == 0
        assert run.result.tokens == tuple(seen) == old.tokens[: len(seen)]
        # The next run: every stage started again on the new file (none kept).
        again = chain.generate(PROMPT, max_tokens=TOKENS)
        assert chain.kept == () and again.restarted == (0, 1, 2)
        again_pids = chain.pids()
        assert again.result.tokens == new.tokens
        # A stream of the old chain that comes to recover only now (the next run
        # started the chain again first) is refused too: its tokens are the old file's.
        with pytest.raises(SourceChanged, match="changed since the chain's stages started"):
            chain.replace(runs[0].runner, (1,), "a stream late to recover")
        assert chain.ready and chain.pids() == again_pids
