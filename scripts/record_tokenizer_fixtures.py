"""Record llama.cpp's tokenizer output as JSON fixtures for tests/runtime_core.

Run with the Python that has llama-cpp-python (0.3.36) and gguf installed:

    /work/llamacpp-venv/bin/python scripts/record_tokenizer_fixtures.py [--out DIR]

For SmolLM2-135M-Instruct (``smollm`` pre-tokenizer), for each vocabulary that
``tests/fixtures/gguf_vocab.py`` writes, and for one byte-level file per other
supported ``tokenizer.ggml.pre`` name, it writes ``<name>.json`` holding:

- ``meta``: the llama-cpp-python version, the tokenizer digest of the file (tests
  regenerate the file and check it), what llama.cpp reports (vocabulary size,
  BOS / EOS ids, whether it adds them);
- ``cases``: for each text of a fixed corpus and (except for the alias files) of a
  seeded random one, the ids of ``llama_tokenize`` for the four combinations of
  ``add_special`` / ``parse_special`` (keys ``"11"``, ``"10"``, ``"01"``, ``"00"``),
  and ``llama_detokenize`` of some of them (keys ``"<ids key>/<remove_special>
  <unparse_special>"``; the text, or ``{"hex": ...}`` for bytes that are not UTF-8);
- ``decodes``: ``llama_detokenize`` of seeded random id lists, all four flag pairs,
  and of every single token (SmolLM2: 600 of them) with and without ``special``.

For SmolLM2, and for each vocabulary with a chat template (Qwen3's, Gemma 3's and
Phi-3.5's), it also writes ``<name>.chat.json``: conversations rendered with the
file's chat template by llama-cpp-python's Jinja2 formatter (or the error the
template raised), the ids llama.cpp gives each rendered text, and llama.cpp's own
``llama_chat_apply_template`` where it recognises the template.

With ``--gguf FILE...`` it records those files instead (same format, plus their
``path``), for a check against vocabularies the tests do not ship, such as the
``ggml-vocab-*.gguf`` files in llama.cpp's source tree; compare them with
``scripts/compare_tokenizer_fixtures.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import attrs  # noqa: E402
import llama_cpp  # noqa: E402
from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # noqa: E402
from tests.fixtures.gguf_vocab import SPECS, VocabSpec, tokenizer_digest, write_vocab  # noqa: E402

from runplan.gguf_header import GgufHeader  # noqa: E402
from runplan.models import resolve_model  # noqa: E402
from runtime_core.tokenizer_pre import PRE_TOKENIZERS  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "llamacpp" / "tokenizer"

# Texts that tell pre-tokenizers and their flags apart (recorded for every file).
PRE_CORPUS = [
    "",
    "Hello world",
    " Hello world",
    "  leading and trailing  ",
    "It's, they're, we've, I'll, he'd, she'S, THEY'RE, 'tis, rock 'n' roll",
    "folding: it'\u017f, \u212aelvin '\u212a, ligature '\ufb06, dotted '\u0130",
    "Hello , world ! Is it ok ? Yes . And ' quoted ' text ' s",
    "don 't won 't I 'm you 're we 've they 'll he 'd it 's",
    "def main(argv: list[str]) -> int:\n    return len(argv)  # done\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "0 1 12 123 1234 12345 123456 1234567",
    "3.14159 2,718,281 1e-9 -42 +7 100% $5.00 #7 v1.2.3",
    "١٢٣ ٤٥٦ ۷۸۹ ⅫⅣ ½ ² ³",
    "Grüße aus Zürich! Ça va très bien, naïve café. über",
    "快速的棕色狐狸跳过了懒狗。我们喜欢机器学习。",
    "Emoji: 😀 🎉 👍🏽 ❤️ 🇺🇸 👨‍👩‍👧‍👦",
    "tabs\there\t\tand\t\t\ttabs",
    "new\nlines\n\nand\n\n\nmore\r\nwindows\r\n",
    "  two  spaces   three    four     five",
    "\u3000ideographic\u3000space\u00a0nbsp\u2009thin\u202fnarrow",
    "<|endoftext|>",
    "a <mask> b  <mask>\t\nc <|im_end|>  d",
    " tokenizer Zürich 123 !!! naïve tokenizers",
    " Q. Quick Q Q! Qu",
]
# More texts, recorded for the main files.
MORE_CORPUS = [
    "HelloWorld camelCase ÉCOLE iPhone XMLHttpRequest getHTTPResponseCode",
    "ÉcoleÉCOLE naïveNAÏVE ΑθήναΑΘΗΝΑ ÆsirØre a !/\n/b !//x path/to//file\n",
    " ",
    "  ",
    "a",
    "Hello world ",
    "Hello, world! How are you? I'm fine; it's OK.",
    '<html><body class="x">&nbsp;</body></html>',
    "x=1;y=2;z=x**y//3%4^5|6&7~8",
    "phone: +1 (555) 010-9999",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "El rápido zorro marrón salta. ¿Qué tal? ¡Hola!",
    "日本語のテキストです。カタカナ、ひらがな。",
    "한국어 텍스트입니다.",
    "العربية نص قصير",
    "हिन्दी में पाठ",
    "ภาษาไทยไม่มีช่องว่าง",
    "😀😀😀",
    "mixed English和中文 and русский текст 123abc",
    "\n",
    "\n\n",
    " \n \n ",
    "trailing newline\n",
    "next\x85line and\x0bvertical\x0cform feed",
    "control\x00chars\x01\x1f\x7f end",
    "zero\u200bwidth\u200djoiner\u2060word",
    "combining e\u0301 a\u0308 n\u0303 and precomposed é ä ñ",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    " <|im_end|> spaced <|im_start|> ",
    "<|im_start|><|im_start|><|im_end|>",
    "<|im_ start|> <|im_start <| im_start|> <|im",
    '<tool_call>{"name": "f"}</tool_call>',
    "<|fim_prefix|>def f():<|end|>",
    "<|unused_0|> <s> </s> <unk> <|begin_of_text|>",
    "<repo_name>a<reponame>b<file_sep>c<filename>d<gh_stars>e",
    "supercalifragilisticexpialidocious" * 20,
    "a" * 500,
    " " * 100 + "x",
    "!" * 64,
    "1" * 50,
    "\U00013460 \U00010d40\U00010d41 \u1b4e\u1b4f new in Unicode 16",
    "\ue000 private \U000f0000 use \ufffd replacement \ufeff bom",
    "\U0001f9d1\u200d\U0001f4bb \u263a\ufe0f \u00a9\u00ae\u2122",
    # whitespace beyond ASCII beside CJK and punctuation (llama.cpp's literal ranges
    # never hold it: deepseek's pre-tokenizers once cut these otherwise)
    "x \u3000 y\u3000\u3001 \u4e2d\u2009\u6587 a\u2002\u3000b x  \u3000",
    # bytes SmolLM2 has no token for: llama.cpp emits nothing for them and merges
    # nothing across them
    " \x04<",
    "<\x04<",
    "..\x06..",
    "==\x13==",
    "--\x14--",
    "**\x16**",
    "))\x1d))",
    "a\x04b",
    "\x04",
    " \x04 \x06 <\x13>",
]
CORPUS = PRE_CORPUS + MORE_CORPUS

# Pieces the random texts are drawn from: scripts, digits, whitespace, punctuation,
# contractions, special tokens and their fragments, emoji, marks, odd code points.
_POOL = [
    "the", " the", "The", " quick", "fox", "jumps", "tokenizer", " tokens", "Zürich",
    "naïve", "über", "Ça", "привет", " мир", "你好", "世界", "日本", "한국", "مرحبا",
    "नमस्ते", "ไทย", "0", "7", "42", "123", "2024", "3.14", "1,000", "٣", "½",
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\u3000", "\u00a0", "\x85", "\x0b",
    ".", ",", "!", "?", ";", ":", "'", '"', "(", ")", "[", "]", "{", "}", "<", ">",
    "-", "_", "=", "+", "*", "/", "\\", "|", "~", "^", "$", "#", "@", "%", "&", "`",
    "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'Re",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "<|im", "|>",
    "<|fim_prefix|>", "<|end|>", "<s>", "</s>",
    "😀", "👍🏽", "❤️", "🇺🇸", "\u200d", "\u0301", "\u0308", "\ufe0f",
    "\U00013460", "\U00010d40", "\u1b4e", "\ue000", "\x00", "\x7f", "\ufffd", " Q",
]  # fmt: skip


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        n = rng.randint(1, 14)
        texts.append("".join(rng.choice(_POOL) for _ in range(n)))
    return texts


class LlamaVocab:
    """llama.cpp's tokenizer of one GGUF file, through llama-cpp-python's C API."""

    def __init__(self, path: str) -> None:
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    def close(self) -> None:
        llama_cpp.llama_model_free(self.model)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode()
        size = len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * size)()
            n = llama_cpp.llama_tokenize(
                self.vocab, data, len(data), buf, size, add_special, parse_special
            )
            if n >= 0:
                return list(buf[:n])
            size = -n

    def detokenize(self, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        size = 64 + 16 * len(ids)
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_detokenize(
                self.vocab, arr, len(ids), buf, size, remove_special, unparse_special
            )
            if n >= 0:
                return buf.raw[:n]
            size = -n + 1

    def meta(self) -> dict[str, Any]:
        v = self.vocab
        return {
            "n_vocab": llama_cpp.llama_vocab_n_tokens(v),
            "bos_id": llama_cpp.llama_vocab_bos(v),
            "eos_id": llama_cpp.llama_vocab_eos(v),
            "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(v)),
            "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(v)),
            "eog_ids": [i for i in range(llama_cpp.llama_vocab_n_tokens(v))
                        if llama_cpp.llama_vocab_is_eog(v, i)],
        }  # fmt: skip


def _text_or_hex(data: bytes) -> str | dict[str, str]:
    """Valid UTF-8 as a string, anything else as ``{"hex": ...}``."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return {"hex": data.hex()}


DECODE_ALL = (("11", False, False), ("11", False, True), ("11", True, False), ("00", False, False))
DECODE_FEW = (("11", False, False), ("00", False, False))


def record_cases(lv: LlamaVocab, texts: list[str], full: bool) -> list[dict[str, Any]]:
    decodes = DECODE_ALL if full else DECODE_FEW
    cases = []
    for text in texts:
        keys = sorted({key for key, _, _ in decodes} | ({"10", "01"} if full else set()))
        ids = {key: lv.tokenize(text, key[0] == "1", key[1] == "1") for key in keys}
        decode = {
            f"{key}/{int(rs)}{int(us)}": _text_or_hex(lv.detokenize(ids[key], rs, us))
            for key, rs, us in decodes
        }
        cases.append({"text": text, "ids": ids, "decode": decode})
    return cases


def record_decodes(lv: LlamaVocab, seed: int, count: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    n_vocab = llama_cpp.llama_vocab_n_tokens(lv.vocab)
    low = list(range(min(n_vocab, 300)))  # bytes, specials, short pieces
    out = []
    for _ in range(count):
        ids = [
            rng.choice(low) if rng.random() < 0.5 else rng.randrange(n_vocab)
            for _ in range(rng.randint(1, 12))
        ]
        out.append(
            {
                "ids": ids,
                "decode": {
                    f"{int(rs)}{int(us)}": _text_or_hex(lv.detokenize(ids, rs, us))
                    for rs in (True, False)
                    for us in (True, False)
                },
            }
        )
    return out


def record_pieces(lv: LlamaVocab, ids: list[int]) -> list[dict[str, Any]]:
    """``llama_detokenize([id])`` of single tokens, with and without ``special``."""
    return [
        {
            "ids": [i],
            "decode": {f"0{int(us)}": _text_or_hex(lv.detokenize([i], False, us)) for us in (0, 1)},
        }
        for i in ids
    ]


def record_file(
    path: str, name: str, *, model: str, pre: str | None, full: bool, spec: VocabSpec | None
) -> dict[str, Any]:
    lv = LlamaVocab(path)
    try:
        texts = CORPUS + random_texts(1234, 100) if full else PRE_CORPUS
        # Every token on its own, for the small vocabularies; SmolLM2's first 400.
        n_vocab = llama_cpp.llama_vocab_n_tokens(lv.vocab)
        pieces = list(range(min(n_vocab, 1000) if full else 0))
        if n_vocab > 1000:
            pieces = list(range(400)) + random.Random(7).sample(range(400, n_vocab), 200)
        return {
            "name": name,
            "spec": None if spec is None else attrs.asdict(spec),
            "llama_cpp_python": llama_cpp.__version__,
            "tokenizer_digest": tokenizer_digest(path),
            "model": model,
            "pre": pre,
            "meta": lv.meta(),
            "encode_keys": "ids[f'{int(add_special)}{int(parse_special)}']",
            "cases": record_cases(lv, texts, full),
            "decodes": record_decodes(lv, 99, 60 if full else 10) + record_pieces(lv, pieces),
        }
    finally:
        lv.close()


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    [
        {"role": "user", "content": "Line one\nline two\n\n  indented"},
        {"role": "assistant", "content": "Ünïcödé 😀 <b>ok</b>"},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
    # A reasoning turn (Qwen3's template keeps only the last one's thinking).
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "  and 3+3?  "},
    ],
    # Roles that do not alternate (Gemma 3's template raises).
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
]
#: Vocabularies recorded on the short corpus only: bpe-qwen2's and spm-phi-3's with a
#: few tokens more, there for their chat templates.
SHORT_SPECS = ("bpe-qwen3", "spm-phi-3.5")
#: Extra template variables each conversation is also rendered with, by the templates
#: that read them.
VARIANTS: list[dict[str, Any]] = [{}, {"enable_thinking": False}]


def record_chat(path: str, source: str) -> dict[str, Any]:
    """The file's chat template rendered by llama-cpp-python's Jinja2 formatter (or
    the error it raised), the ids llama.cpp gives the rendered text (specials parsed,
    none added: the template writes them), and llama.cpp's built-in
    ``llama_chat_apply_template`` where it recognises the template."""
    lv = LlamaVocab(path)
    try:
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(lv.model, b"tokenizer.chat_template", buf, len(buf))
        template = buf.value.decode()
        assert n > 0 and template
        piece = lambda i: llama_cpp.llama_vocab_get_text(lv.vocab, i).decode()  # noqa: E731
        bos, eos = (
            piece(llama_cpp.llama_vocab_bos(lv.vocab)),
            piece(llama_cpp.llama_vocab_eos(lv.vocab)),
        )
        rendered = []
        variants = [v for v in VARIANTS if all(name in template for name in v)]
        for messages in CONVERSATIONS:
            for variables in variants:
                for add_generation_prompt in (True, False):
                    case: dict[str, Any] = {
                        "messages": messages,
                        "add_generation_prompt": add_generation_prompt,
                        "variables": variables,
                    }
                    try:
                        jinja = Jinja2ChatFormatter(
                            template,
                            eos_token=eos,
                            bos_token=bos,
                            add_generation_prompt=add_generation_prompt,
                        )(messages=messages, **variables).prompt
                    except Exception as exc:  # the template's raise_exception
                        case["error"] = str(exc)
                    else:
                        case["jinja"] = jinja
                        case["ids"] = lv.tokenize(jinja, False, True)
                        case["llama_chat_apply_template"] = _apply_template(
                            template, messages, add_generation_prompt
                        )
                    rendered.append(case)
        return {
            "source": source,
            "llama_cpp_python": llama_cpp.__version__,
            "tokenizer_digest": tokenizer_digest(path),
            "bos_token": bos,
            "eos_token": eos,
            "rendered": rendered,
        }
    finally:
        lv.close()


def _apply_template(template: str, messages: list[dict[str, str]], add_ass: bool) -> str | None:
    """llama.cpp's built-in rendering, or None where it does not know the template."""
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
    chat = (llama_cpp.llama_chat_message * len(keep))(
        *(llama_cpp.llama_chat_message(role=r, content=c) for r, c in keep)
    )
    size = 1 << 16
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(keep), add_ass, buf, size)
    if n < 0:
        return None
    return buf.raw[:n].decode()


@llama_cpp.llama_log_callback
def _QUIET(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Drops llama.cpp's log lines (kept at module level: ctypes must not free it)."""


def _dumps(value: Any, depth: int = 0) -> str:
    """JSON with one line per list item down to the cases, compact below."""
    if depth < 3 and isinstance(value, dict):
        inner = ",\n".join(f"{json.dumps(k)}: {_dumps(v, depth + 1)}" for k, v in value.items())
        return "{\n" + inner + "\n}"
    if depth < 3 and isinstance(value, list) and value and isinstance(value[0], dict):
        return "[\n" + ",\n".join(_dumps(v, 3) for v in value) + "\n]"
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _write(out: Path, name: str, data: dict[str, Any]) -> None:
    path = out / f"{name}.json"
    path.write_text(_dumps(data) + "\n")
    print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def record_paths(paths: list[Path], out: Path) -> None:
    """Record other GGUF files (by path) into ``out``, named by their stems."""
    for path in paths:
        header = GgufHeader.read(path)
        model = header.string("tokenizer.ggml.model")
        pre = header.string("tokenizer.ggml.pre", "") or None
        data = record_file(str(path), path.stem, model=model, pre=pre, full=True, spec=None)
        _write(out, path.stem, {**data, "path": str(path.resolve())})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--gguf",
        type=Path,
        nargs="+",
        help="record these files instead (for a check outside the test suite)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())
    if args.gguf:
        record_paths(args.gguf, args.out)
        return

    smol = resolve_model("smollm2-135m")
    _write(
        args.out,
        "smollm2-135m",
        record_file(smol, "smollm2-135m", model="gpt2", pre="smollm", full=True, spec=None),
    )
    _write(args.out, "smollm2-135m.chat", record_chat(smol, "smollm2-135m"))

    covered = {spec.pre for spec in SPECS.values()}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in SPECS.values():
            path = str(write_vocab(Path(tmp) / f"{spec.name}.gguf", spec))
            full = spec.name not in SHORT_SPECS
            data = record_file(
                path, spec.name, model=spec.model, pre=spec.pre, full=full, spec=spec
            )
            _write(args.out, spec.name, data)
            if spec.chat_template is not None:
                _write(args.out, f"{spec.name}.chat", record_chat(path, spec.name))
        aliases = {}
        for pre in sorted(set(PRE_TOKENIZERS) - covered):
            spec = VocabSpec(f"bpe-alias-{pre}", pre=pre, add_bos=False)
            path = str(write_vocab(Path(tmp) / f"{spec.name}.gguf", spec))
            aliases[pre] = record_file(
                path, spec.name, model="gpt2", pre=pre, full=False, spec=spec
            )
        _write(args.out, "bpe-aliases", aliases)


if __name__ == "__main__":
    main()
