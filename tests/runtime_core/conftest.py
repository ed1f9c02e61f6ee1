"""Shared fixtures: the tokenizers of the files llama.cpp's fixtures were recorded
from, and SmolLM2 bound in one stage.

``tests/fixtures/llamacpp/tokenizer/*.json`` come from
``scripts/record_tokenizer_fixtures.py``. SmolLM2 is the bundled file; every other
file is regenerated here by ``tests/fixtures/gguf_vocab.py`` and checked against
the tokenizer digest the fixture recorded, so a test never compares against ids
llama.cpp produced for a different vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from runtime_core.tokenizer import Tokenizer
from tests.fixtures.gguf_vocab import SPECS, VocabSpec, tokenizer_digest, write_vocab
from tests.support.chain import Chain, provisions

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "llamacpp" / "tokenizer"
CHAT_FIXTURE = "smollm2-135m.chat"
ALIASES_FIXTURE = "bpe-aliases"
MAIN_FIXTURES = ("smollm2-135m", *SPECS)


@cache
def fixture(name: str) -> Any:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def recorded(name: str) -> dict[str, Any]:
    """One recorded file: a main fixture, or ``alias:<pre>`` for an alias file."""
    if name.startswith("alias:"):
        data: dict[str, Any] = fixture(ALIASES_FIXTURE)[name.removeprefix("alias:")]
        return data
    main: dict[str, Any] = fixture(name)
    return main


def alias_names() -> list[str]:
    return [f"alias:{pre}" for pre in fixture(ALIASES_FIXTURE)]


@pytest.fixture(scope="session")
def recorded_tokenizer(
    smollm2_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Tokenizer]:
    """``name -> Tokenizer`` of the file a fixture was recorded from."""
    built: dict[str, Tokenizer] = {}
    folder = tmp_path_factory.mktemp("vocab")

    def get(name: str) -> Tokenizer:
        if name not in built:
            data = recorded(name)
            if data["spec"] is None:
                path = Path(smollm2_path)
            else:
                spec = VocabSpec(**data["spec"])
                path = write_vocab(folder / f"{spec.name}.gguf", spec)
            assert tokenizer_digest(path) == data["tokenizer_digest"], (
                f"{path} is not the vocabulary {name} was recorded from: "
                "rerun scripts/record_tokenizer_fixtures.py"
            )
            built[name] = Tokenizer.from_gguf(path)
        return built[name]

    return get


@pytest.fixture(scope="session")
def vocab_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[[VocabSpec], Path]:
    """Write a generated vocabulary file (once per spec)."""
    folder = tmp_path_factory.mktemp("specs")
    written: dict[VocabSpec, Path] = {}

    def get(spec: VocabSpec) -> Path:
        if spec not in written:
            written[spec] = write_vocab(folder / f"{len(written)}-{spec.name}.gguf", spec)
        return written[spec]

    return get


@pytest.fixture(scope="session")
def smollm2_chain(smollm2_path: str) -> Iterator[Chain]:
    """SmolLM2 in one stage (first and last), greedy, returning logits."""
    chain = Chain.bind(provisions(smollm2_path, 1, max_seq_len=96))
    yield chain
    chain.release()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where regenerated fixture models are written (once per session)."""
    return tmp_path_factory.mktemp("models")
