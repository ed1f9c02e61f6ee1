# The compiled extension (csrc/module.c). Arrays are C-contiguous NumPy arrays of the
# element types named; the extension checks every one.
from collections.abc import Sequence
from typing import Any

QTYPES: tuple[str, ...]
KNOWN_ISAS: tuple[str, ...]  # every instruction set the kernels know, portable first
POISON: int  # 1 in a debug build: scratch memory starts as 0xFF bytes (csrc/scratch.h)
AVXVNNI_AS_EVEX: int  # 1 in a test build: the avxvnni set on AVX-512's VNNI (make avxvnni-as-evex)

class Matrix:
    n_in: int
    n_out: int
    act_format: str  # "q8_0", "q8_1", "q8_K", or "f32" for float weights
    repacked: tuple[bool, ...]  # per part: copied 8 rows at a time (csrc/repack.h)
    def __init__(
        self,
        parts: Sequence[tuple[Any, str, int, int, int]],
        repack: bool = False,
        threads: int = 1,
    ) -> None: ...

def linear(
    matrix: Matrix,
    rows: int,
    x: Any,
    q: Any,
    d: Any,
    s: Any,
    g: Any,
    quantize: bool,
    use_q8: bool,
    y: Any,
    bias: Any | None,
    accumulate: bool,
    threads: int,
    /,
    *,
    isa: str | None = None,
) -> None: ...
def linear_spans(
    matrices: Sequence[Matrix],
    spans: Sequence[tuple[int, int]],
    x: Any,
    q: Any | None,
    d: Any | None,
    s: Any | None,
    g: Any | None,
    y: Any,
    threads: int,
    /,
    *,
    isa: str | None = None,
) -> None: ...
def quantize(
    fmt: str,
    x: Any,
    rows: int,
    n: int,
    q: Any,
    d: Any,
    s: Any,
    g: Any,
    *,
    isa: str | None = None,
) -> None: ...
def rmsnorm(
    x: Any,
    weight: Any,
    out: Any,
    rows: int,
    n: int,
    eps: float,
    threads: int,
    accumulate: bool = False,
) -> None: ...
def swiglu(
    h: Any, act: Any, rows: int, ffn: int, threads: int, *, isa: str | None = None
) -> None: ...
def exp32(x: Any, y: Any, *, isa: str | None = None) -> None: ...
def tanh32(x: Any, y: Any, *, isa: str | None = None) -> None: ...
def geglu(h: Any, act: Any, rows: int, ffn: int, threads: int) -> None: ...
def softcap(logits: Any, cap: float, threads: int, *, isa: str | None = None) -> None: ...
def scale(x: Any, factor: float, threads: int) -> None: ...
def add_scaled(x: Any, y: Any, factor: float, threads: int) -> None: ...

# heads: (n_heads, n_kv, head_dim_k, head_dim_v, ring positions, kv_half)
Heads = tuple[int, int, int, int, int, bool]

def qk_norm(
    qkv: Any,
    rows: int,
    bias: Any | None,
    q_norm: Any,
    k_norm: Any,
    heads: Heads,
    eps: float,
    threads: int,
) -> None: ...
def rope_kv(
    qkv: Any,
    rows: int,
    bias: Any | None,
    rot: Any,
    pos: int,
    heads: Heads,
    n_rot: int,
    neox: bool,
    k_cache: Any,
    v_cache: Any,
    threads: int,
    q_scale: float = 1.0,
    k_step: Any | None = None,
    v_step: Any | None = None,
    temps: Any | None = None,
) -> None: ...
def attention(
    qkv: Any,
    rows: int,
    k_cache: Any,
    v_cache: Any,
    pos: int,
    heads: Heads,
    scale: float,
    out: Any,
    threads: int,
    window: int = 0,
    k_step: Any | None = None,
    v_step: Any | None = None,
    *,
    isa: str | None = None,
    softcap: float = 0.0,
) -> None: ...
def embed(table: Matrix, ids: Any, out: Any, threads: int) -> None: ...
def argmax(logits: Any) -> tuple[int, int]: ...
def isas() -> tuple[str, ...]: ...  # those this processor runs, portable first, the best last

class KvCache:
    """One run's KV cache as a Program's rotary and attention calls take it."""

    def __init__(self, k: Sequence[Any], v: Sequence[Any], heads: Sequence[Heads]) -> None: ...
    def __len__(self) -> int: ...

class Program:
    """Kernel calls recorded (each method takes the module function's arguments; rotary
    and attention also their ``slot=(segment, block)``), made again in order by ``run``."""

    segments: int
    def __len__(self) -> int: ...
    def linear(self, *args: Any, isa: str | None = None) -> None: ...
    def rmsnorm(self, *args: Any) -> None: ...
    def swiglu(self, *args: Any, isa: str | None = None) -> None: ...
    def geglu(self, *args: Any) -> None: ...
    def softcap(self, *args: Any, isa: str | None = None) -> None: ...
    def scale(self, *args: Any) -> None: ...
    def add_scaled(self, *args: Any) -> None: ...
    def qk_norm(self, *args: Any) -> None: ...
    def embed(self, *args: Any) -> None: ...
    def argmax(self, logits: Any) -> None: ...
    def rope_kv(self, *args: Any, slot: tuple[int, int]) -> None: ...
    def attention(self, *args: Any, slot: tuple[int, int], **kw: Any) -> None: ...
    def run(self, positions: Sequence[int], caches: Sequence[KvCache]) -> list[tuple[int, int]]: ...
