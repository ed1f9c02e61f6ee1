from __future__ import annotations

from pathlib import Path

import pytest

from runplan.models import resolve_model
from runtime_core.tokenizer import Tokenizer
from tests.fixtures.gguf_models import ModelShape, write_model


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-block random-weight llama with SmolLM2's chat template (its vocabulary has
    ``<|im_start|>`` and ``<|im_end|>``, the end of a turn and the model's EOS)."""
    template = Tokenizer.from_gguf(resolve_model("smollm2-135m")).vocab.chat_template
    assert template is not None
    path = tmp_path_factory.mktemp("serve") / "tiny-chat.gguf"
    shape = ModelShape(n_layers=4, context_length=1024)
    return str(write_model(Path(path), shape, extra_keys={"tokenizer.chat_template": template}))
