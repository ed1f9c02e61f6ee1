"""Check the tables of files we refuse because llama.cpp refuses them (and of those we
take because it runs them) against llama.cpp itself.

    PYTHONPATH=src:. .venv/bin/python scripts/check_refusals_llamacpp.py \
        /work/llamacpp-venv/bin/python

Writes each row's file of ``tests/runplan/test_key_types.py`` (a key of another type
than llama.cpp reads; a key it reads of every file, and the same key of its type, which
runs), ``tests/runtime_core/test_hidden_wide_attention.py`` (heads that
do not fill ``embedding_length``), ``tests/runtime_core/test_value_heads.py`` (value
heads of another size than the key heads) and
``tests/runtime_core/test_whole_head_rotary.py`` (a rotary over half of each head), and
of the files llama.cpp runs that were once refused here
(``tests/runtime_core/test_converter_variants.py``: qwen2 without Q/K/V biases;
``tests/runplan/test_gguf_facts.py``: ``vocab_size`` other than the token list's;
``tests/runtime_core/test_no_context_length.py``: ``context_length`` 0, run at ``n_ctx``
64), loads it with llama-cpp-python in a process of its own (some refusals are ``GGML_ASSERT``
aborts) and evaluates three tokens. Prints a line per row; exits 1 where llama.cpp
disagrees with the table. CI never runs it (the
tests need no llama.cpp); run it when llama.cpp moves.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.fixtures.gguf_models import write_model
from tests.runplan import test_gguf_facts as gguf_facts
from tests.runplan import test_key_types as key_types
from tests.runtime_core import test_converter_variants as variants
from tests.runtime_core import test_hidden_wide_attention as wide
from tests.runtime_core import test_no_context_length as no_context
from tests.runtime_core import test_value_heads as values
from tests.runtime_core import test_whole_head_rotary as rotary

from runplan.key_types import every_file_type

LOAD = (
    "import sys; from llama_cpp import Llama; "
    "m = Llama(model_path=sys.argv[1], n_ctx=64, verbose=False); m.eval([1, 2, 3])"
)


def rows(folder: Path) -> Iterator[tuple[str, Path, bool]]:
    """(what, file, llama.cpp runs it) for each row of the tables."""
    for i, (arch, key_form, value, vtype, _) in enumerate(key_types.ROWS):
        key = key_form.format(a=arch)
        here = folder / f"types{i}"
        here.mkdir()
        yield (
            f"{key} as {vtype.name} {value!r}",
            key_types.write_row(here, arch, key, value, vtype),
            False,
        )
    for i, (arch, key_form, value, vtype) in enumerate(key_types.EVERY_FILE_ROWS):
        key = key_form.format(a=arch)
        for runs, stored in ((False, vtype), (True, every_file_type(key, arch))):
            assert stored is not None
            here = folder / f"every{i}-{stored.name}"
            here.mkdir()
            path = key_types.write_every_file_row(here, arch, key, value, stored)
            yield f"{arch} {key} as {stored.name} {value!r}", path, runs
    for i, (arch, changes, kwargs, key) in enumerate(wide.REFUSED):
        path = write_model(folder / f"wide{i}.gguf", wide.shape(arch, changes), **kwargs)
        yield f"{arch} heads not filling embedding_length ({key})", path, False
    for arch, changes in wide.TAKEN:
        path = write_model(folder / f"taken-{arch}.gguf", wide.shape(arch, changes))
        yield f"{arch} heads not filling embedding_length", path, True
    for arch in sorted(values.ARCHITECTURES):
        here = folder / f"values-{arch}"
        here.mkdir()
        yield f"{arch} value heads twice the key heads", values.wide_values(here, arch), False
    for arch, runs in rotary.PARTIAL_ROTARY_RUNS.items():
        here = folder / f"rotary-{arch}"
        here.mkdir()
        yield f"{arch} rotary over half of each head", rotary.half_rotary(here, arch), runs
    for i, case in enumerate(sorted(variants.UNBIASED_QWEN2)):
        here = folder / f"unbiased{i}"
        here.mkdir()
        yield f"qwen2 with {case}", variants.unbiased_qwen2(here, case), True
    for i, stated in enumerate(gguf_facts.VOCAB_SIZES_BESIDE_THE_LIST):
        here = folder / f"vocab{i}"
        here.mkdir()
        path = gguf_facts.vocab_size_beside_the_list(here, stated)
        yield f"vocab_size {stated} beside a list of 323 tokens", path, True
    here = folder / "no-context"
    here.mkdir()
    yield "context_length 0", no_context.no_context_length(here), True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("llamacpp_python", help="a python that imports llama_cpp")
    args = parser.parse_args()
    wrong = 0
    with tempfile.TemporaryDirectory() as tmp:
        for what, path, runs in rows(Path(tmp)):
            done = subprocess.run(
                [args.llamacpp_python, "-c", LOAD, str(path)],
                check=False,
                capture_output=True,
                timeout=120,
            )
            ran = done.returncode == 0
            wrong += ran != runs
            said = "runs" if ran else f"refuses (exit {done.returncode})"
            print(f"{'ok ' if ran == runs else 'BAD'} {what}: llama.cpp {said}")
    print(f"{wrong} rows where llama.cpp disagrees")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
