"""Plans written before a field was carried (``wire.OPTIONAL_KEYS``) still read: a plan
saved by ``runplan plan --json`` before ``model.eog_token_ids`` existed reads with none
(``eos_token_id`` alone ends its runs, as it did then); any other key missing is still a
``WireError``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runplan import wire
from runplan.check import check_plan
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain import plan_for


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("older") / "m.gguf", ModelShape(n_layers=4))


def test_a_plan_written_before_its_end_of_generation_ids_reads_with_none(model: Path) -> None:
    plan = plan_for(model, 2)
    doc = json.loads(wire.dumps(plan))
    del doc["model"]["eog_token_ids"]
    old = wire.loads(json.dumps(doc).encode())
    assert old.model.eog_token_ids == () and old.model.end_token_ids == {plan.model.eos_token_id}
    assert check_plan(old) == old
    del doc["model"]["eos_token_id"]  # a key every plan ever written has
    with pytest.raises(wire.WireError, match="lacks the key 'eos_token_id'"):
        wire.loads(json.dumps(doc).encode())
