"""Hypothesis fuzzing of whole-file copies of SmolLM2 and four small models (three of
them written by llama.cpp's quantizer, one with sliding-window blocks): flipped bytes,
cuts anywhere, forged counts, lengths, types, dimensions, offsets and values, bytes
that are not UTF-8 in strings (``tests.fuzz.mutants``), through facts, the tokenizer,
the plan, the slice loader and a step (``tests.fuzz.pipeline``). Every refusal is a
typed error naming the file, every mutant ends within its time limit, and at least a
tenth of the mutants get past the header checks to the slice loader, so that the
deeper stages are fuzzed too.

CI runs ``FACTS_MUTANTS`` and ``DEEP_MUTANTS`` mutants, the same ones each run
(``derandomize``); ``make fuzz`` runs 100,000 and 2,000 new ones and prints the same
counts. The counts of each run are printed at the end of the test session.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fuzz.mutants import Base
from tests.fuzz.pipeline import REPORTS, Tally, fuzz, load_bases

#: Minutes, not seconds (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.slow

FACTS_MUTANTS = int(os.environ.get("GGUF_FUZZ_FACTS", "3000"))
DEEP_MUTANTS = int(os.environ.get("GGUF_FUZZ_DEEP", "600"))
#: SmolLM2's header takes ten times a small model's: drawn once for every 24 others.
WEIGHTS = (1, 6, 6, 6, 6)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> list[Base]:
    return load_bases(tmp_path_factory.mktemp("fuzz"))


def test_damaged_headers_give_typed_errors_at_once(bases: list[Base]) -> None:
    tally = Tally("GGUF fuzz, facts only")
    REPORTS.append(tally)
    fuzz(bases, WEIGHTS, FACTS_MUTANTS, tally, deep=False, derandomize=True)
    assert tally.mutants >= FACTS_MUTANTS
    assert 0 < tally.passed < tally.mutants  # some mutants parse, some do not


def test_damaged_files_through_tokenizer_slice_loader_and_a_step(bases: list[Base]) -> None:
    tally = Tally("GGUF fuzz, every stage")
    REPORTS.append(tally)
    fuzz(bases, WEIGHTS, DEEP_MUTANTS, tally, deep=True, derandomize=True)
    assert tally.mutants >= DEEP_MUTANTS
    assert tally.reached["slice"] >= tally.mutants / 10, tally.lines()
    assert tally.reached["step"] > 0 and tally.passed > 0, tally.lines()


def test_an_unchanged_copy_reads_as_its_source(bases: list[Base], tmp_path: Path) -> None:
    """The mutants are copies of the real files: with no operation, every stage reads
    the copy as the original and passes."""
    from tests.fuzz.mutants import Mutant
    from tests.fuzz.pipeline import run_one

    for base in bases:
        tally = Tally(base.name)
        run_one(base, Mutant(base.name, ()), tally, deep=True)
        assert tally.passed == 1, (base.name, tally.refused)
        assert (
            base.write(Mutant(base.name, ())).read_bytes()[: base.header_end]
            == base.path.read_bytes()[: base.header_end]
        )
        base.restore()
