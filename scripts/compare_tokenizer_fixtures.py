"""Print how often runtime_core's tokenizer agrees with recorded llama.cpp output.

    PYTHONPATH=src python scripts/compare_tokenizer_fixtures.py [DIR] [--show N]

``DIR`` (default: the committed fixtures) holds JSON files written by
``scripts/record_tokenizer_fixtures.py``. For each recorded file (and each entry of
``bpe-aliases.json``) it prints the tokenizer model, the pre-tokenizer, and
matching/total counts for encodes and decodes, then up to ``--show`` mismatches.
A file recorded with ``--gguf`` is read from its recorded path; a generated one is
regenerated (and its tokenizer digest checked); SmolLM2 is the bundled file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests.fixtures.gguf_vocab import VocabSpec, tokenizer_digest, write_vocab  # noqa: E402

from runplan.models import resolve_model  # noqa: E402
from runtime_core.tokenizer import Tokenizer, TokenizerError  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "llamacpp" / "tokenizer"


def _bytes(value: str | dict[str, str]) -> bytes:
    return bytes.fromhex(value["hex"]) if isinstance(value, dict) else value.encode()


def _path(data: dict[str, Any], tmp: Path) -> Path:
    if "path" in data:
        return Path(data["path"])
    if data["spec"] is None:
        return Path(resolve_model("smollm2-135m"))
    spec = VocabSpec(**data["spec"])
    path = write_vocab(tmp / f"{spec.name}.gguf", spec)
    if tokenizer_digest(path) != data["tokenizer_digest"]:
        raise SystemExit(f"{spec.name}: the generator no longer writes the recorded vocabulary")
    return path


def compare(data: dict[str, Any], tmp: Path, show: int) -> None:
    label = f"{data['name']:32} {data['model']:6} {data['pre']!s:14}"
    try:
        tok = Tokenizer.from_gguf(_path(data, tmp))
    except TokenizerError as exc:
        print(f"{label} not loaded: {type(exc).__name__}: {exc}")
        return
    enc = [0, 0]
    dec = [0, 0]
    bad: list[str] = []
    for case in data["cases"]:
        for key, want in case["ids"].items():
            got = tok.encode(case["text"], add_special=key[0] == "1", parse_special=key[1] == "1")
            enc[0] += got == want
            enc[1] += 1
            if got != want:
                bad.append(f"  encode {case['text']!r} [{key}]: {got} != llama.cpp {want}")
        for key, want in case["decode"].items():
            ids_key, flags = key.split("/")
            got_b = tok.decode_bytes(
                case["ids"][ids_key], remove_special=flags[0] == "1", special=flags[1] == "1"
            )
            dec[0] += got_b == _bytes(want)
            dec[1] += 1
            if got_b != _bytes(want):
                bad.append(f"  decode {case['ids'][ids_key]} [{key}]: {got_b!r} != {want!r}")
    for case in data["decodes"]:
        for flags, want in case["decode"].items():
            got_b = tok.decode_bytes(
                case["ids"], remove_special=flags[0] == "1", special=flags[1] == "1"
            )
            dec[0] += got_b == _bytes(want)
            dec[1] += 1
            if got_b != _bytes(want):
                bad.append(f"  decode {case['ids']} [{flags}]: {got_b!r} != {want!r}")
    print(f"{label} encode {enc[0]}/{enc[1]}  decode {dec[0]}/{dec[1]}")
    for line in bad[:show]:
        print(line[:300])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, nargs="?", default=FIXTURES)
    parser.add_argument("--show", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for path in sorted(args.dir.glob("*.json")):
            if path.name.endswith(".chat.json"):
                continue
            data = json.loads(path.read_text())
            entries = data.values() if path.stem == "bpe-aliases" else [data]
            for entry in entries:
                compare(entry, Path(tmp), args.show)


if __name__ == "__main__":
    main()
