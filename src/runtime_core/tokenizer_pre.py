"""llama.cpp's pre-tokenizers (``tokenizer.ggml.pre``) for byte-level BPE vocabularies.

A byte-level BPE tokenizer first cuts the text into pieces with one or more regexes,
applied in turn: each regex splits every piece left by the previous one, and both
its matches and the text between them become pieces. BPE merges never cross a
piece boundary. llama.cpp names each way of cutting (``llama-bpe``, ``qwen2``,
``smollm``, ...) and pairs it with a few flags; this module holds that table for the
families we support, as regexes for the ``tokenizers`` library (Oniguruma syntax).

The regexes are written so that Oniguruma classifies characters the way llama.cpp
does:

- *whitespace* is Unicode's White_Space set, spelled out rather than left to ``\\s``;
- *letters*, *numbers* and *punctuation* are Unicode's ``L``, ``N`` and ``P``
  categories, less the code points that Unicode 16.0 added to them: llama.cpp's
  tables (in the llama-cpp-python 0.3.36 we test against) predate 16.0 and treat
  those code points as unassigned ("other"), while the Oniguruma inside
  ``tokenizers`` knows 16.0.

The contraction alternatives are case-sensitive character classes (``'[sS]``), as
llama.cpp spells them, not ``(?i:...)``, which would also fold characters such as
U+017F (long s) into ``s``.
"""

from __future__ import annotations

from attrs import frozen

# Unicode's White_Space property: what llama.cpp counts as whitespace.
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# Code points that Oniguruma (Unicode 16.0) puts in L / N / P and llama.cpp does not.
_NEW_IN_16 = {
    "L": (
        (0x01C89, 0x01C8A), (0x0A7CB, 0x0A7CD), (0x0A7DA, 0x0A7DC), (0x105C0, 0x105F3),
        (0x10D4A, 0x10D65), (0x10D6F, 0x10D85), (0x10EC2, 0x10EC4), (0x11380, 0x11389),
        (0x1138B, 0x1138B), (0x1138E, 0x1138E), (0x11390, 0x113B5), (0x113B7, 0x113B7),
        (0x113D1, 0x113D1), (0x113D3, 0x113D3), (0x11BC0, 0x11BE0), (0x13460, 0x143FA),
        (0x16100, 0x1611D), (0x16D40, 0x16D6C), (0x18CFF, 0x18CFF), (0x1E5D0, 0x1E5ED),
        (0x1E5F0, 0x1E5F0),
    ),
    "N": (
        (0x10D40, 0x10D49), (0x116D0, 0x116E3), (0x11BF0, 0x11BF9), (0x16130, 0x16139),
        (0x16D70, 0x16D79), (0x1CCF0, 0x1CCF9), (0x1E5F1, 0x1E5FA),
    ),
    "P": (
        (0x01B4E, 0x01B4F), (0x01B7F, 0x01B7F), (0x10D6E, 0x10D6E), (0x113D4, 0x113D5),
        (0x113D7, 0x113D8), (0x11BE1, 0x11BE1), (0x16D6D, 0x16D6F), (0x1E5FF, 0x1E5FF),
    ),
}  # fmt: skip


def _ranges(*cats: str) -> str:
    return "".join(f"{chr(a)}-{chr(b)}" for c in cats for a, b in _NEW_IN_16[c])


def _category(cat: str) -> str:
    """``\\p{cat}`` as llama.cpp's tables have it."""
    return f"[\\p{{{cat}}}&&[^{_ranges(cat)}]]"


L = _category("L")
N = _category("N")
P = _category("P")
S = f"[{_WS}]"  # whitespace
NOT_S = f"[^{_WS}]"
# [^\s\p{L}\p{N}]: neither whitespace, letter nor number (new code points included).
OTHER = f"(?:[^{_WS}\\p{{L}}\\p{{N}}]|[{_ranges('L', 'N')}])"
# [^\r\n\p{L}\p{N}]
NOT_CRLF_L_N = f"(?:[^\\r\\n\\p{{L}}\\p{{N}}]|[{_ranges('L', 'N')}])"

_CONTRACTIONS_CS = "'s|'t|'re|'ve|'m|'ll|'d"
_CONTRACTIONS_ANY_CASE = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

# GPT-2's split: contractions, words, numbers, other runs, each with one optional
# leading space; whitespace runs leave their last character to the next piece.
GPT2 = f"{_CONTRACTIONS_CS}| ?{L}+| ?{N}+| ?{OTHER}+|{S}+(?!{NOT_S})|{S}+"


def _llama3_like(numbers: str) -> str:
    return (
        f"{_CONTRACTIONS_ANY_CASE}|{NOT_CRLF_L_N}?{L}+|{numbers}| ?{OTHER}+[\\r\\n]*"
        f"|{S}*[\\r\\n]+|{S}+(?!{NOT_S})|{S}+"
    )


LLAMA3 = _llama3_like(f"{N}{{1,3}}")
QWEN2 = _llama3_like(N)

# tekken (Mistral Nemo, Mistral Small 3): llama.cpp's rewrite of its tokenizer.json
# regex, whose "uppercase" letters are the letters outside a-z and "lowercase" ones
# those outside A-Z (so a letter of another script is both), a number alone, and
# other runs followed by line breaks or slashes.
_UPPERISH = f"(?:(?={L})[^a-z])"
_LOWERISH = f"(?:(?={L})[^A-Z])"
TEKKEN = (
    f"{NOT_CRLF_L_N}?{_UPPERISH}*{_LOWERISH}+|{NOT_CRLF_L_N}?{_UPPERISH}+{_LOWERISH}*"
    f"|{N}| ?{OTHER}+[\\r\\n/]*|{S}*[\\r\\n]+|{S}+(?!{NOT_S})|{S}+"
)
# gpt-4o (Phi-4-mini, Llama 4): tekken's words, each with an optional contraction after
# it, and numbers of up to three digits.
_C = f"{_CONTRACTIONS_ANY_CASE}?"
GPT4O = (
    f"{NOT_CRLF_L_N}?{_UPPERISH}*{_LOWERISH}+{_C}|{NOT_CRLF_L_N}?{_UPPERISH}+{_LOWERISH}*{_C}"
    f"|{N}{{1,3}}| ?{OTHER}+[\\r\\n/]*|{S}*[\\r\\n]+|{S}+(?!{NOT_S})|{S}+"
)
THREE_DIGITS = "[0-9][0-9][0-9]"

# CJK ideographs, U+0800..U+9FA5 (llama.cpp's "[一-龥ࠀ-一]"), and Hangul, less the
# whitespace in that range (U+1680, U+2000..U+200A, U+3000, ...): llama.cpp runs these
# regexes on a copy of the text whose non-ASCII whitespace is U+000B, which no literal
# range holds (so "中\u2009文" is three pieces, and " \u3000" one).
_CJK = f"[\u0800-\u9fa5\uac00-\ud7ff&&[^{_WS}]]+"
# deepseek-coder: line breaks, letter runs, punctuation runs (each with one optional
# whitespace before), CJK runs, single numbers, cut in turn.
DEEPSEEK_CODER = ("[\\r\\n]", f"{S}?{L}+", f"{S}?{P}+", _CJK, N)
# deepseek-llm: its letters are a list of code point ranges (Unicode's cased letters,
# as llama.cpp spells them), its punctuation ASCII's and the full-width forms.
_DEEPSEEK_LETTERS = (
    (0x0041, 0x005A), (0x0061, 0x007A), (0x00B5, 0x00B5), (0x00C0, 0x00D6), (0x00D8,
    0x00F6), (0x00F8, 0x01BA), (0x01BC, 0x01BF), (0x01C4, 0x0293), (0x0295, 0x02AF),
    (0x0370, 0x0373), (0x0376, 0x0376), (0x0377, 0x0377), (0x037B, 0x037D), (0x037F,
    0x037F), (0x0386, 0x0386), (0x0388, 0x038A), (0x038C, 0x038C), (0x038E, 0x03A1),
    (0x03A3, 0x03F5), (0x03F7, 0x0481), (0x048A, 0x052F), (0x0531, 0x0556), (0x10A0,
    0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF),
    (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18,
    0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59),
    (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6,
    0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3),
    (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102,
    0x2102), (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D),
    (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128), (0x212A, 0x212D), (0x212F,
    0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149), (0x214E, 0x214E),
    (0x2183, 0x2183), (0x2184, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB,
    0x2CEE), (0x2CF2, 0x2CF2), (0x2CF3, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B),
    (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00,
    0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F),
    (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2),
    (0x118A0, 0x118DF), (0x1E900, 0x1E943)
)  # fmt: skip
_DEEPSEEK_LETTER = (
    "[" + "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in _DEEPSEEK_LETTERS) + "]"
)
DEEPSEEK_LLM = (
    "[\\r\\n]",
    f"{S}?{_DEEPSEEK_LETTER}+",
    f"{S}?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3001-\u3002]+",  # (U+3000: _CJK)
    f"{S}+\\z",
    _CJK,
    f"{N}+",
)
# seed-coder: llama3's contractions and words, single numbers, other runs.
SEED_CODER = (
    f"{_CONTRACTIONS_ANY_CASE}|{NOT_CRLF_L_N}?{L}+|{N}| ?{OTHER}+|{S}*[\\r\\n]+"
    f"|{S}+(?!{NOT_S})|{S}+"
)


@frozen
class PreTokenizer:
    """One family of llama.cpp pre-tokenizers: the regexes applied in turn, and the
    flags llama.cpp sets for the name."""

    family: str
    regexes: tuple[str, ...]
    clean_spaces: bool = True  # detokenizing drops spaces before punctuation
    ignore_merges: bool = False  # a piece that is a whole token is taken as is
    add_bos: bool = False  # default when the file has no add_bos_token key


_DEFAULT = PreTokenizer("default", (f"(?:{P}|[$+<=>^~|])+", GPT2, f"{N}+", THREE_DIGITS))
_GPT2 = PreTokenizer("gpt-2", (GPT2,))
_LLAMA3 = PreTokenizer("llama3", (LLAMA3,), ignore_merges=True, add_bos=True)
_SMOLLM = PreTokenizer("smollm", (N, GPT2))
_QWEN2 = PreTokenizer("qwen2", (QWEN2,))
_FALCON = PreTokenizer("falcon", (f"(?:{P}|[$+<=>^~|`])+", GPT2, THREE_DIGITS))
_GPT4O = PreTokenizer("gpt-4o", (GPT4O,), clean_spaces=False)
_DEEPSEEK_CODER = PreTokenizer("deepseek-coder", DEEPSEEK_CODER, clean_spaces=False)
_DEEPSEEK_LLM = PreTokenizer("deepseek-llm", DEEPSEEK_LLM, clean_spaces=False)
_SEED_CODER = PreTokenizer("seed-coder", (SEED_CODER,), clean_spaces=False)
_TEKKEN = PreTokenizer("tekken", (TEKKEN,), clean_spaces=False, ignore_merges=True, add_bos=True)


def _with(base: PreTokenizer, **changes: bool) -> PreTokenizer:
    return PreTokenizer(base.family, base.regexes, **{**_flags(base), **changes})


def _flags(p: PreTokenizer) -> dict[str, bool]:
    return {"clean_spaces": p.clean_spaces, "ignore_merges": p.ignore_merges, "add_bos": p.add_bos}


# ``tokenizer.ggml.pre`` -> pre-tokenizer, for the names llama.cpp gives these families.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        _LLAMA3,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _with(_LLAMA3, ignore_merges=False, add_bos=False)),
    **dict.fromkeys(
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "exaone4",
            "mpt",
            "olmo",
            "jais",
        ),
        _GPT2,
    ),
    **dict.fromkeys(("trillion", "granite-docling"), _with(_GPT2, clean_spaces=False)),
    **dict.fromkeys(("smollm", "command-r"), _with(_SMOLLM, clean_spaces=False)),
    **dict.fromkeys(
        ("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"), _SMOLLM
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open"),
        _with(_QWEN2, clean_spaces=False),
    ),
    **dict.fromkeys(("megrez", "stablelm2"), _QWEN2),
    "falcon": _FALCON,
    "tekken": _TEKKEN,
    "deepseek-coder": _DEEPSEEK_CODER,
    "deepseek-llm": _DEEPSEEK_LLM,
    "seed-coder": _SEED_CODER,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie"), _GPT4O),
}

# Names llama.cpp knows that this module does not implement (other regex families,
# or tokenizers that are BPE only in name). Used to word the error.
LLAMA_CPP_ONLY = frozenset(
    {
        "deepseek-v3", "spark2_5", "youtu", "jais-2",
        "gemma4", "granite-embed-multi-311m", "sarvam-moe", "jina-v1-en", "jina-v2-code",
        "roberta-bpe", "whitespace", "qwen35", "poro-chat", "glm4", "chatglm-bpe", "viking",
        "bloom", "gpt3-finnish", "exaone-moe", "chameleon",
        "granite-embed-multi-97m", "tiny_aya", "cohere2moe", "superbpe",
        "bailingmoe", "bailingmoe2", "llada-moe", "hunyuan-dense", "hy_v4",
        "joyai-llm", "kimi-k2", "ufakzeka", "grok-2", "afmoe", "laguna", "minimax-m2",
        "minicpm5",
    }
)  # fmt: skip
