"""Checks of single inputs, shared by ``plan_run`` (over its inputs) and ``check_plan``
(over a plan from elsewhere). Each returns a rejection or ``None``."""

from __future__ import annotations

import math

from runplan.config import RuntimeConfig, SamplingConfig, Timeouts, WorkerCapabilities
from runplan.dtypes import VALID_WIDTHS, DTypeFamily
from runplan.facts import ModelFacts
from runplan.plan import MAX_RUN_ID_BYTES, U64_MAX
from runplan.pool import NodePool
from runplan.rejections import (
    InconsistentModelFacts,
    InvalidAlignment,
    InvalidConfig,
    InvalidDtypeWidth,
    InvalidExtent,
    PlanRejection,
    UnsupportedLayout,
    UnsupportedModel,
)
from runplan.specs import is_power_of_two

U32_MAX = 2**32 - 1
#: the most bytes a worker may hold a weight element in (float64's 8)
MAX_WEIGHT_BYTES_PER_ELEMENT = 8


def id_problem(text: str) -> str | None:
    """Why ``text`` cannot be an id or a path of a plan (run id, node id, orchestrator
    id, GGUF path), or ``None``: it must not be empty, and must hold no NUL and no lone
    surrogate (the wire and the object header carry UTF-8, which has none)."""
    if not text:
        return "must not be empty"
    if "\x00" in text:
        return "must not hold NUL"
    if has_lone_surrogate(text):
        return "must not hold a lone surrogate (the wire carries UTF-8 only)"
    return None


def has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a code point UTF-8 cannot encode (U+D800..U+DFFF)."""
    return any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)


def check_id(text: str, field: str) -> PlanRejection | None:
    """``invalid_config`` naming ``field`` for an id the wire cannot carry."""
    problem = id_problem(text)
    return InvalidConfig(field, repr(text), problem) if problem else None


def check_run_id(run_id: str) -> PlanRejection | None:
    rejection = check_id(run_id, "run_id")
    if rejection:
        return rejection
    encoded = run_id.encode("utf-8")
    if len(encoded) > MAX_RUN_ID_BYTES:
        return InvalidConfig(
            "run_id",
            repr(run_id),
            f"{len(encoded)} UTF-8 bytes; the object header holds at most {MAX_RUN_ID_BYTES}",
        )
    return None


def check_pool(pool: NodePool) -> PlanRejection | None:
    """Ids the wire can carry, and memory it can count (``0..2**64-1`` bytes)."""
    rejection = check_id(pool.orchestrator_node_id, "orchestrator_node_id")
    if rejection:
        return rejection
    for i, node in enumerate(pool.nodes):
        rejection = check_id(node.node_id, f"nodes[{i}].node_id")
        if rejection:
            return rejection
        if not 0 <= node.memory_bytes <= U64_MAX:
            return InvalidConfig(
                f"nodes[{i}].memory_bytes",
                str(node.memory_bytes),
                f"node {node.node_id!r}: must be in 0..2**64-1 bytes (what a plan carries)",
            )
    return None


def check_max_tokens(max_tokens: int) -> PlanRejection | None:
    if not 1 <= max_tokens <= U32_MAX:
        return InvalidConfig("max_tokens", str(max_tokens), f"must be in 1..{U32_MAX}")
    return None


def check_sampling(sampling: SamplingConfig) -> PlanRejection | None:
    t = sampling.temperature
    if not (math.isfinite(t) and t >= 0.0):
        return InvalidConfig("sampling.temperature", repr(t), "must be finite and >= 0")
    if not 0 <= sampling.top_k <= U32_MAX:
        return InvalidConfig(
            "sampling.top_k", str(sampling.top_k), f"must be in 0..{U32_MAX} (0: off)"
        )
    p = sampling.top_p
    if not (math.isfinite(p) and 0.0 < p <= 1.0):
        return InvalidConfig("sampling.top_p", repr(p), "must be in (0, 1] (1: off)")
    if not 0 <= sampling.seed <= U64_MAX:
        return InvalidConfig("sampling.seed", str(sampling.seed), "must be in 0..2**64-1")
    if not 0 <= sampling.tokens_delivered <= U32_MAX:
        return InvalidConfig(
            "sampling.tokens_delivered",
            str(sampling.tokens_delivered),
            f"must be in 0..{U32_MAX} (tokens an interrupted run delivered)",
        )
    return None


#: The shortest heartbeat bound: a stage beats four times per bound, and a beat more
#: often than every 25 ms would be a cost of its own.
MIN_HEARTBEAT_MS = 100


def check_timeouts(timeouts: Timeouts) -> PlanRejection | None:
    for name in ("ready_ms", "step_ms", "edge_wait_ms", "stop_ms"):
        value = getattr(timeouts, name)
        if not 1 <= value <= U32_MAX:
            return InvalidConfig(f"timeouts.{name}", str(value), f"must be in 1..{U32_MAX} ms")
    if not 0 <= timeouts.step_row_ms <= U32_MAX:
        return InvalidConfig(
            "timeouts.step_row_ms", str(timeouts.step_row_ms), f"must be in 0..{U32_MAX} ms"
        )
    if not MIN_HEARTBEAT_MS <= timeouts.heartbeat_ms <= U32_MAX:
        return InvalidConfig(
            "timeouts.heartbeat_ms",
            str(timeouts.heartbeat_ms),
            f"must be in {MIN_HEARTBEAT_MS}..{U32_MAX} ms",
        )
    return None


def check_batching(config: RuntimeConfig) -> PlanRejection | None:
    """The chain's settings for several runs (CONCURRENT_RUNS.md): a prompt length,
    run count, budget and batch rows the header and the stages can hold, and a prefill
    chunk that fits one batch."""
    ranges = (
        ("prompt_tokens", config.prompt_tokens, 0, U32_MAX, "(0: not known)"),
        ("max_concurrent_runs", config.max_concurrent_runs, 1, U32_MAX, ""),
        ("kv_budget_bytes", config.kv_budget_bytes, 0, U64_MAX, "(0: from max_concurrent_runs)"),
        ("max_batch_rows", config.max_batch_rows, 1, U32_MAX, ""),
    )
    for name, value, low, high, note in ranges:
        if not low <= value <= high:
            return InvalidConfig(name, str(value), f"must be in {low}..{high} {note}".rstrip())
    if not 0 <= config.prefill_chunk <= config.max_batch_rows:
        return InvalidConfig(
            "prefill_chunk",
            str(config.prefill_chunk),
            f"must be in 0..max_batch_rows ({config.max_batch_rows}): a chunk is one "
            "batch's rows at most (0: the prompt in chunks of max_batch_rows)",
        )
    return None


def check_slot_count(slot_count: int, what: str) -> PlanRejection | None:
    if slot_count < 1:
        return InvalidConfig(what, str(slot_count), "a ring needs at least one slot")
    if slot_count > U32_MAX:
        return InvalidConfig(what, str(slot_count), f"must be in 1..{U32_MAX}")
    return None


def check_alignment(alignment: int, what: str) -> PlanRejection | None:
    if not is_power_of_two(alignment) or alignment > 2**30:
        return InvalidAlignment(what, alignment)
    return None


def check_dtype(family: DTypeFamily, width: int, what: str) -> PlanRejection | None:
    valid = VALID_WIDTHS[family]
    if width not in valid:
        return InvalidDtypeWidth(what, family.value, width, tuple(sorted(valid)))
    return None


def check_activation_family(family: DTypeFamily, what: str) -> PlanRejection | None:
    if family is DTypeFamily.UINT:
        return UnsupportedLayout(
            what, "activations are ROW_MAJOR float rows; an integer dtype has no such layout"
        )
    return None


def check_extent(value: int, what: str, expected: int | None = None) -> PlanRejection | None:
    if value <= 0:
        return InvalidExtent(what, value, expected, "an extent must be at least one byte")
    if value > U64_MAX:
        return InvalidExtent(what, value, expected, "overflows the header's u64 extent")
    if expected is not None and value != expected:
        return InvalidExtent(what, value, expected, "does not follow the model facts")
    return None


def check_facts(facts: ModelFacts) -> PlanRejection | None:
    """Facts that contradict themselves or the layout the planner relies on."""
    positive = (
        "num_layers",
        "hidden_dim",
        "head_count",
        "head_count_kv",
        "head_dim_k",
        "head_dim_v",
        "vocab_size",
        "embedding_bytes",
        "output_bytes",
    )
    for name in positive:
        value = getattr(facts, name)
        if value < 1:
            return InconsistentModelFacts(name, str(value), "must be at least 1")
        if value > U64_MAX:
            return InconsistentModelFacts(name, str(value), "does not fit in 64 bits")
    for name in ("shared_bytes", "context_length"):  # context_length 0: none stated
        if getattr(facts, name) < 0:
            return InconsistentModelFacts(name, str(getattr(facts, name)), "is negative")
    if facts.context_length > U64_MAX:
        return InconsistentModelFacts(
            "context_length", str(facts.context_length), "does not fit in 64 bits"
        )
    if facts.max_seq_len < 1:
        why = "a run needs at least one position"
        if facts.context_length == 0:
            why += " (the model's file states no context length to default to: give one)"
        return InconsistentModelFacts("max_seq_len", str(facts.max_seq_len), why)
    if facts.num_layers > U32_MAX:
        return InconsistentModelFacts("num_layers", str(facts.num_layers), "exceeds u32")
    if facts.head_count % facts.head_count_kv:
        return InconsistentModelFacts(
            "head_count_kv",
            str(facts.head_count_kv),
            f"does not divide head_count {facts.head_count}",
        )
    if facts.block_elements and len(facts.block_elements) != facts.num_layers:
        return InconsistentModelFacts(
            "block_elements",
            f"{len(facts.block_elements)} blocks",
            f"num_layers is {facts.num_layers}",
        )
    if len(facts.block_bytes) != facts.num_layers:
        return InconsistentModelFacts(
            "block_bytes",
            f"{len(facts.block_bytes)} blocks",
            f"num_layers is {facts.num_layers}",
        )
    for i, size in enumerate(facts.block_bytes):
        if size < 1:
            return InconsistentModelFacts(f"block_bytes[{i}]", str(size), "a block has no bytes")
        if size > U64_MAX:
            return InconsistentModelFacts(f"block_bytes[{i}]", str(size), "does not fit in 64 bits")
    rejection = _check_elements(facts)
    if rejection:
        return rejection
    for name in ("layer_windows", "layer_rope_freq_bases"):
        per_layer = getattr(facts, name)
        if per_layer and len(per_layer) != facts.num_layers:
            return InconsistentModelFacts(
                name, f"{len(per_layer)} blocks", f"num_layers is {facts.num_layers}"
            )
    for i, window in enumerate(facts.layer_windows):
        if not 0 <= window <= U64_MAX:
            return InconsistentModelFacts(
                f"layer_windows[{i}]", str(window), "a window is 0 (global) or a position count"
            )
    rejection = check_end_tokens(facts.eos_token_id, facts.eog_token_ids, facts.vocab_size)
    if rejection:
        return rejection
    return check_model_strings(facts.model_id, facts.architecture, facts.gguf_source.paths)


def check_end_tokens(
    eos_token_id: int, eog_token_ids: tuple[int, ...], vocab_size: int
) -> PlanRejection | None:
    """The ids that end generation are in the vocabulary, the others once each."""
    if not 0 <= eos_token_id < vocab_size:
        return InconsistentModelFacts(
            "eos_token_id", str(eos_token_id), f"outside vocab 0..{vocab_size - 1}"
        )
    for i, token in enumerate(eog_token_ids):
        if not 0 <= token < vocab_size:
            return InconsistentModelFacts(
                f"eog_token_ids[{i}]", str(token), f"outside vocab 0..{vocab_size - 1}"
            )
    if len(set(eog_token_ids)) != len(eog_token_ids):
        return InconsistentModelFacts("eog_token_ids", str(list(eog_token_ids)), "an id repeats")
    return None


def _check_elements(facts: ModelFacts) -> PlanRejection | None:
    """Element counts (what a dequantizing worker holds): never negative, and, when the
    facts carry them, some for every block and for the embedding and the head, whose
    bytes say they have some."""
    counts = [(f"block_elements[{i}]", n) for i, n in enumerate(facts.block_elements)]
    counts += [(name, getattr(facts, name)) for name in _PART_ELEMENTS]
    known = bool(facts.block_elements)
    for name, n in counts:
        if not 0 <= n <= U64_MAX:
            return InconsistentModelFacts(name, str(n), "must be in 0..2**64-1")
        if known and n == 0 and name != "shared_elements":
            return InconsistentModelFacts(
                name, "0", "the part has bytes, so it has elements (0 only when none are known)"
            )
    return None


_PART_ELEMENTS = ("embedding_elements", "output_elements", "shared_elements")


def check_model_strings(
    model_id: str, architecture: str, paths: tuple[str, ...]
) -> PlanRejection | None:
    """The model's strings the plan carries: GGUF paths that are ids (``id_problem``),
    and a model id and architecture the wire can carry."""
    if not paths:
        return InconsistentModelFacts("gguf_source", repr(paths), "names no file")
    for i, path in enumerate(paths):
        problem = id_problem(path)
        if problem:
            return InconsistentModelFacts(f"gguf_source.paths[{i}]", repr(path), problem)
    for name, text in (("model_id", model_id), ("architecture", architecture)):
        if has_lone_surrogate(text):
            return InconsistentModelFacts(
                name, repr(text), "must not hold a lone surrogate (the wire carries UTF-8 only)"
            )
    return None


def check_worker_capabilities(worker: WorkerCapabilities) -> PlanRejection | None:
    """Capabilities no worker can have (``RuntimeConfig.worker`` is a run-wide setting):
    ``invalid_config`` naming ``worker.<field>`` and its value."""
    weight = worker.weight_bytes_per_element
    if not 0 <= weight <= MAX_WEIGHT_BYTES_PER_ELEMENT:
        return InvalidConfig(
            "worker.weight_bytes_per_element",
            str(weight),
            f"a worker holds a weight in 0 (as stored) to {MAX_WEIGHT_BYTES_PER_ELEMENT} "
            "(float64) bytes",
        )
    kv = worker.kv_bytes_per_element
    if kv and kv not in VALID_WIDTHS[DTypeFamily.FLOAT]:
        return InvalidConfig(
            "worker.kv_bytes_per_element",
            str(kv),
            f"a KV element of {kv} bytes: a worker holds its KV cache in float32 (4) or "
            "float16 (2), or in the activations' width (0)",
        )
    if worker.row_multiple < 1:
        return InvalidConfig(
            "worker.row_multiple", str(worker.row_multiple), "must be at least 1 (1: any length)"
        )
    return None


def check_worker(facts: ModelFacts, worker: WorkerCapabilities) -> PlanRejection | None:
    """The worker's capabilities are possible ones (``check_worker_capabilities``), it
    runs the model's architecture and quant types, and the facts say what the memory
    check needs to count the weights as the worker holds them."""
    rejection = check_worker_capabilities(worker)
    if rejection:
        return rejection
    bad_quants = tuple(q for q in facts.quant_types if q not in worker.quant_types)
    experts = facts.expert_count > 0 and not worker.experts
    if facts.architecture not in worker.architectures or bad_quants or experts:
        return UnsupportedModel(
            worker=worker.name,
            architecture=facts.architecture + (" (a mixture of experts)" if experts else ""),
            unsupported_quant_types=bad_quants,
            supported_architectures=tuple(worker.architectures),
            supported_quant_types=tuple(worker.quant_types),
        )
    if worker.weight_bytes_per_element > 0 and not facts.block_elements:
        return InconsistentModelFacts(
            "block_elements",
            "()",
            f"worker {worker.name!r} holds weights at {worker.weight_bytes_per_element} bytes "
            "per element, and the facts carry no element counts (model_facts_from_gguf "
            "reads them)",
        )
    return None
