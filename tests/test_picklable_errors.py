"""Every error of the four packages crosses a process boundary as it was raised (a Ray
task's, a process pool's, a queue's pickle): the same class, message, ``args`` and
attributes. Python rebuilds an exception by calling its class with ``args``; one whose
``__init__`` takes other arguments (a path and a message) raised ``TypeError`` on
unpickling (``runplan.picklable_error``). A value class's ``TypeError`` carries the
field's ``attrs.Attribute``: a lambda as its converter or default made it unpicklable
(``runplan._fields``)."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
from typing import Any

import attrs
import pytest

from runplan import SamplingConfig
from runplan.dtypes import DTypeFamily
from runplan.messages import StageModelFacts
from runplan.rejections import UnknownNode
from runplan.replacement import Unplaceable
from runtime_cupy.edges.handshake import Refusal

PACKAGES = ("runplan", "runtime_core", "runtime_cupy", "runtime_sim")

#: each error with its own ``__init__`` (module, name) -> arguments to raise it with
RAISED: dict[tuple[str, str], tuple[tuple[Any, ...], dict[str, Any]]] = {
    ("runplan.gguf_error", "GgufError"): (("m.gguf", "truncated"), {"key": "general.name"}),
    ("runplan.gguf_reader", "BadKey"): (("general.alignment", "3: not a power of two"), {}),
    ("runplan.interrupted", "Interrupted"): (("SIGTERM",), {}),
    ("runplan.lazy_exports", "DuplicateExport"): (("pkg", "x", ("pkg.a", "pkg.b")), {}),
    ("runplan.shards", "ManifestError"): (("m.json", "not JSON"), {}),
    ("runtime_core.chain_orchestrator", "RunRefused"): (("r1", "too long"), {}),
    ("runtime_core.chat", "NoChatTemplate"): (("m.gguf",), {}),
    ("runtime_core.errors", "UnsupportedModel"): (
        ("m.gguf", "no such type"),
        {"tensor": "blk.0.attn_q.weight", "key": None},
    ),
    ("runtime_core.runs", "PlanRejected"): ((UnknownNode("n9", 1),), {}),
    ("runtime_core.tokenizer_vocab", "UnknownTokenizerModel"): (("m.gguf", "rwkv"), {}),
    ("runtime_core.tokenizer_vocab", "UnknownPreTokenizer"): (("m.gguf", "odd"), {}),
    ("runtime_core.workers.interface", "KvCacheUnavailable"): (("r1", 100, 10, 50), {}),
    ("runtime_cupy.batch", "BatchError"): (("no tokens",), {"index": 3}),
    ("runtime_cupy.edges.handshake", "HandshakeRefused"): (
        ("bad MAC",),
        {"refusal": next(iter(Refusal)), "protection": 1},
    ),
    ("runtime_cupy.process.control_channel", "_UnreadableFrame"): (("s1", 7, "bad"), {}),
    ("runtime_cupy.serve.chain_errors", "SourceChanged"): (
        ("/m.gguf changed since the chain's stages started: inode 5 -> 9",),
        {},
    ),
    ("runtime_cupy.serve.chain_errors", "Unplaced"): (
        (Unplaceable(("n1",), (1,), UnknownNode("n1", 1)), ["n0"]),
        {},
    ),
    ("runtime_cupy.serve.request_errors", "RequestError"): (
        ("bad temperature",),
        {"param": "temperature", "status": 400, "code": "bad"},
    ),
    ("runtime_cupy.slices.fetch", "_Failed"): (("the header", "reset"), {}),
    ("runtime_cupy.slices.protocol", "ProtectionMismatch"): (("no", 1, "sealed", "plain"), {}),
    ("runtime_cupy.slices.protocol", "BrokenSeal"): (("chunk 3", 4), {}),
}


def _own_classes() -> list[tuple[str, str, type]]:
    """(module, name, class) of every class the four packages define."""
    found = []
    for package in PACKAGES:
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            if info.name.rsplit(".", 1)[-1] == "__main__":
                continue
            try:
                module = importlib.import_module(info.name)
            except ImportError:  # an optional engine (CuPy, Ray) this host lacks
                continue
            for name, value in vars(module).items():
                if inspect.isclass(value) and value.__module__ == module.__name__:
                    found.append((module.__name__, name, value))
    return found


def _errors_with_own_init() -> set[tuple[str, str]]:
    return {
        (module, name)
        for module, name, cls in _own_classes()
        if issubclass(cls, BaseException) and "__init__" in vars(cls)
    }


def test_every_error_with_its_own_init_is_checked_here() -> None:
    """A new error with its own ``__init__`` is added to ``RAISED`` (and so checked)."""
    assert _errors_with_own_init() - set(RAISED) == set()


@pytest.mark.parametrize("where", sorted(RAISED), ids=lambda w: w[1])
def test_an_error_unpickles_as_it_was_raised(where: tuple[str, str]) -> None:
    cls = getattr(importlib.import_module(where[0]), where[1])
    args, kwargs = RAISED[where]
    raised = cls(*args, **kwargs)
    back = pickle.loads(pickle.dumps(raised))
    assert type(back) is cls
    assert (str(back), back.args, vars(back)) == (str(raised), raised.args, vars(raised))


def test_every_field_of_every_attrs_class_pickles() -> None:
    """What a field's ``TypeError`` carries: its converter, validator and default."""
    unpicklable = []
    for module, name, cls in _own_classes():
        for field in attrs.fields(cls) if attrs.has(cls) else ():
            try:
                pickle.dumps(field)
            except (AttributeError, TypeError, pickle.PicklingError) as e:
                unpicklable.append(f"{module}.{name}.{field.name}: {e}")
    assert unpicklable == []


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SamplingConfig(temperature="0.5"), "temperature"),  # float_field
        (lambda: SamplingConfig(top_p=None), "top_p"),
        (
            lambda: StageModelFacts("m", "llama", 8, DTypeFamily.FLOAT, 4, 16, "x"),
            "kv_dtype_width_bytes",  # kv_width_field's default
        ),
    ],
    ids=["temperature", "top_p", "kv_dtype_width_bytes"],
)
def test_a_value_class_type_error_unpickles_as_it_was_raised(make: Any, field: str) -> None:
    """A float field's once failed "Can't pickle local object 'float_field.<locals>...'"
    (what a process pool's caller saw, instead of the TypeError)."""
    with pytest.raises(TypeError) as info:
        make()
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is TypeError and str(back) == str(info.value)
    assert back.args[1].name == field
