"""What the SIMT emulator's loader does to CUDA source text before g++ sees it.

``rewrite_shared``: every ``__shared__`` declaration becomes a call into ``simt.h``, so
that each block of a launch gets its own, fresh shared arrays (and ASan sees each as an
allocation of its exact size):

    __shared__ float a[8], b[4][32];     (in a function)
    -> typedef float _simt_shared_1[8]; _simt_shared_1& a = ::simt::detail::shared_var<
       _simt_shared_1, 1>("a"); typedef float _simt_shared_2[4][32]; ...
    extern __shared__ float dyn[];        (in a function)
    -> float* const dyn = (float*)::simt::detail::dynamic_shared();

At file scope the name becomes a macro for the same expression. Line numbers are kept
(a ``#line`` directive follows a macro's own line), so g++'s and ASan's reports point at
the original source.

``find_kernels``: the ``__global__`` functions of a translation unit and their launch
bounds, read from ``g++ -E`` output made with ``SIMT_DISCOVER`` (``simt.h`` then writes
``__global__`` as ``SIMT_GLOBAL_KERNEL`` and ``__launch_bounds__(n)`` as
``SIMT_LAUNCH_BOUNDS(n)``, with ``n`` macro-expanded).
"""

from __future__ import annotations

import ast
import operator
import re

from attrs import frozen


class RewriteError(ValueError):
    """A ``__shared__`` declaration or a kernel the loader cannot read."""


def mask_comments_and_strings(text: str) -> str:
    """``text`` with every comment, string and character literal replaced by spaces
    (newlines kept), so that searches see only code, at the same offsets."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


_SHARED = re.compile(r"\b(?:(extern)\s+)?(?:static\s+)?__shared__\b")
_ALIGN = re.compile(r"\b(?:alignas|__align__)\s*\(([^()]*)\)")
_FIRST = re.compile(
    r"^(?P<type>.*?)(?P<ptr>[\s*&]*)(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]*\]\s*)*)$", re.S
)
_NEXT = re.compile(r"^(?P<ptr>[\s*&]*)(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]*\]\s*)*)$", re.S)
_SCOPE_OPENER = re.compile(r'(?:\bnamespace(?:\s+[A-Za-z_][\w:]*)?|\bextern\s*"C")\s*$')


def _statement_end(masked: str, start: int) -> int:
    depth = 0
    for i in range(start, len(masked)):
        c = masked[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == ";" and depth == 0:
            return i
    raise RewriteError(f"a __shared__ declaration at offset {start} has no ';'")


def _split_top_level(text: str) -> list[str]:
    parts, depth, last = [], 0, 0
    for i, c in enumerate(text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    parts.append(text[last:])
    return parts


def _file_scope(text: str, masked: str, at: int) -> bool:
    """Whether offset ``at`` is outside every function (in namespaces or extern "C" only)."""
    stack: list[bool] = []  # per open brace: does it open a namespace / extern "C" block
    for i in range(at):
        c = masked[i]
        if c == "{":
            stack.append(bool(_SCOPE_OPENER.search(text[max(0, i - 200) : i])))
        elif c == "}" and stack:
            stack.pop()
    return all(stack)


def rewrite_shared(text: str, path: str, first_id: int = 1) -> tuple[str, int]:
    """``text`` (the file ``path``) with its ``__shared__`` declarations rewritten; also the
    next unused id (ids are unique across the files of one translation unit)."""
    masked = mask_comments_and_strings(text)
    pieces: list[str] = []
    done = 0
    next_id = first_id
    for m in _SHARED.finditer(masked):
        if m.start() < done:
            continue
        end = _statement_end(masked, m.end())
        body = text[m.end() : end]
        attrs = " ".join(f"__attribute__((aligned({a.group(1)})))" for a in _ALIGN.finditer(body))
        body = _ALIGN.sub(" ", body)
        line = text.count("\n", 0, end) + 1
        newlines = text.count("\n", m.start(), end + 1)
        file_scope = _file_scope(text, masked, m.start())
        decls = _split_top_level(body)
        first = _FIRST.match(decls[0].strip())
        if first is None or not first.group("type").strip():
            raise RewriteError(f"{path}:{line}: cannot read the __shared__ declaration {body!r}")
        base_type = first.group("type").strip()
        parsed = [(first.group("ptr"), first.group("name"), first.group("dims"))]
        for d in decls[1:]:
            more = _NEXT.match(d.strip())
            if more is None:
                raise RewriteError(f"{path}:{line}: cannot read the declarator {d!r}")
            parsed.append((more.group("ptr"), more.group("name"), more.group("dims")))
        out: list[str] = []
        macros: list[str] = []
        for raw_ptr, name, dims in parsed:
            ptr = raw_ptr.replace(" ", "").replace("\n", "")
            if m.group(1):  # extern __shared__ T name[]: the dynamic shared memory
                if dims.strip() != "[]":
                    raise RewriteError(f"{path}:{line}: extern __shared__ {name} is not T name[]")
                expr = f"(({base_type}{ptr}*)::simt::detail::dynamic_shared())"
                if file_scope:
                    macros.append(f"#define {name} {expr}")
                else:
                    out.append(f"{base_type}{ptr}* const {name} = {expr};")
                continue
            tname = f"_simt_shared_{next_id}"
            out.append(f"typedef {attrs} {base_type} {ptr}{tname}{dims.strip()};")
            expr = f'::simt::detail::shared_var<{tname}, {next_id}>("{name}")'
            next_id += 1
            if file_scope:
                macros.append(f"#define {name} ({expr})")
            else:
                out.append(f"{tname}& {name} = {expr};")
        replacement = " ".join(out)
        if macros:
            replacement += "\n" + "\n".join(macros) + f'\n#line {line} "{path}"\n'
        else:
            replacement += "\n" * newlines
        pieces.append(text[done : m.start()])
        pieces.append(replacement)
        done = end + 1
    pieces.append(text[done:])
    return "".join(pieces), next_id


@frozen
class KernelDecl:
    name: str
    launch_bounds: int | None


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.LShift: operator.lshift}  # fmt: skip


def _evaluate(expr: str) -> int:
    """An integer constant expression of the preprocessed source (``32 * 8``, ``(1 << 10)``)."""
    cleaned = re.sub(r"(\d+)[uUlL]+\b", r"\1", expr).replace("/", "//")

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return int(_OPS[type(node.op)](value(node.left), value(node.right)))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise RewriteError(f"launch bounds {expr!r} are not an integer constant expression")

    try:
        tree = ast.parse(cleaned.strip(), mode="eval")
    except SyntaxError as exc:
        raise RewriteError(
            f"launch bounds {expr!r} are not an integer constant expression"
        ) from exc
    return value(tree.body)


def _matching_paren(text: str, at: int) -> int:
    depth = 0
    for i in range(at, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise RewriteError("unbalanced parentheses after __launch_bounds__")


_TOKEN = re.compile(r"\s*(SIMT_LAUNCH_BOUNDS\b|[A-Za-z_]\w*|\(|\S)")


def find_kernels(preprocessed: str) -> list[KernelDecl]:
    """The ``__global__`` functions of ``g++ -E -DSIMT_DISCOVER`` output, in order."""
    kernels: list[KernelDecl] = []
    seen: set[str] = set()
    for m in re.finditer(r"\bSIMT_GLOBAL_KERNEL\b", preprocessed):
        at = m.end()
        bounds: int | None = None
        name: str | None = None
        while True:
            t = _TOKEN.match(preprocessed, at)
            if t is None:
                raise RewriteError("a __global__ function without a parameter list")
            token = t.group(1)
            if token == "SIMT_LAUNCH_BOUNDS":
                start = preprocessed.index("(", t.end(1))
                close = _matching_paren(preprocessed, start)
                bounds = _evaluate(_split_top_level(preprocessed[start + 1 : close])[0])
                at = close + 1
                continue
            if token == "(":
                break
            if re.fullmatch(r"[A-Za-z_]\w*", token):
                name = token
            at = t.end()
        if name is None or name in ("void",):
            raise RewriteError("a __global__ function without a name")
        if name in seen:  # a declaration, then the definition
            continue
        seen.add(name)
        kernels.append(KernelDecl(name, bounds))
    return kernels
