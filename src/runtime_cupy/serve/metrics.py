"""What ``GET /metrics`` shows, in Prometheus's text format (``prometheus_client``, a
registry of the server's own):

- ``gguf_pipeline_requests_total{endpoint, outcome}``: requests by outcome, each once
  however many choices (``n``) it asks for, when its last choice ends, as the worst of
  theirs: ``completed`` (answered: a stop, EOS or the token limit), ``cancelled`` (the
  client went away), ``rejected`` (a 4xx: a bad request, a wrong key, a full queue),
  ``faulted`` (the pipeline failed the run);
- ``gguf_pipeline_prompt_tokens_total`` (a request's prompt once, if a choice was
  answered), ``gguf_pipeline_completion_tokens_total`` (every choice's tokens: an
  answered one's when it ends, one its client left, a stop of the server or a fault
  ended the tokens it was sent);
- ``gguf_pipeline_time_to_first_token_seconds``: arrival to the first token (queueing
  included), and ``gguf_pipeline_time_per_output_token_seconds``: between the first and
  the last token, per token (histograms, a sample per choice);
- ``gguf_pipeline_queue_length`` (choices waiting: a request of ``n`` choices is ``n``
  runs; ``--max-queue`` counts them too), ``gguf_pipeline_requests_running`` (choices
  running), ``gguf_pipeline_runs_waiting_for_memory`` (choices started whose run the
  chain holds for KV memory: a stage refused its cache, or the budgets have no room for
  it yet; not counted as running, though each keeps its place among
  ``--max-concurrent``), ``gguf_pipeline_stages_ready`` (1 once every stage
  is up and bound), ``gguf_pipeline_stage_restarts_total``;
- ``gguf_pipeline_runs_in_flight`` (runs on the chain: provisioning, decoding or
  tearing down, and those waiting for room in the stages' KV budgets), and
  ``gguf_pipeline_kv_cache_bytes{stage}`` / ``gguf_pipeline_kv_cache_share{stage}``:
  the KV cache the runs in flight hold on each stage, in bytes and as a share of its
  budget;
- ``gguf_pipeline_batch_rows{stage}``: the rows of each batch (one worker call) a stage
  ran, a histogram in rows (buckets 1, 2, 4, ... 512): a stage reports its batches in
  each ``StageStopped``, so they show once a run on the chain stops (the run that
  binds the stages included, and chains started again after a fault).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

if TYPE_CHECKING:
    from runtime_cupy.serve.recovery import Recoveries

OUTCOMES = ("completed", "cancelled", "faulted", "rejected")
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Upper bounds of the batch-rows buckets (a batch holds at most ``max_batch_rows``).
BATCH_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

#: Batches by stage: stage index -> rows -> batches.
BatchCounts = Mapping[int, Mapping[int, int]]

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Live:
    """The values read from the server when scraped."""

    def __init__(
        self,
        queued: Callable[[], int],
        started: Callable[[], tuple[int, int]],
        ready: Callable[[], bool],
        restarts: Callable[[], int],
        in_flight: Callable[[], int],
        kv: Callable[[], tuple[tuple[int, int, int], ...]],
        batches: Callable[[], BatchCounts],
    ) -> None:
        self.queued, self.started, self.ready, self.restarts = queued, started, ready, restarts
        self.in_flight, self.kv, self.batches = in_flight, kv, batches

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "gguf_pipeline_queue_length", "Choices waiting (n per request)", self.queued()
        )
        running, waiting_for_memory = self.started()  # one reading: each run counted once
        yield GaugeMetricFamily(
            "gguf_pipeline_requests_running", "Choices running (n per request)", running
        )
        yield GaugeMetricFamily(
            "gguf_pipeline_runs_waiting_for_memory",
            "Choices started whose run waits for KV memory on the chain (not running)",
            waiting_for_memory,
        )
        yield GaugeMetricFamily(
            "gguf_pipeline_stages_ready", "1 when every stage is up and bound", int(self.ready())
        )
        yield CounterMetricFamily(
            "gguf_pipeline_stage_restarts", "Stages started again after they broke", self.restarts()
        )
        yield GaugeMetricFamily(
            "gguf_pipeline_runs_in_flight", "Runs on the chain now", self.in_flight()
        )
        used = GaugeMetricFamily(
            "gguf_pipeline_kv_cache_bytes", "KV cache the runs hold, by stage", labels=["stage"]
        )
        share = GaugeMetricFamily(
            "gguf_pipeline_kv_cache_share",
            "KV cache the runs hold, as a share of the stage's budget",
            labels=["stage"],
        )
        for stage, held, budget in self.kv():
            used.add_metric([str(stage)], held)
            share.add_metric([str(stage)], held / budget if budget else 0.0)
        yield used
        yield share
        yield batch_rows_histogram(self.batches())


def batch_rows_histogram(counts: BatchCounts) -> HistogramMetricFamily:
    """``gguf_pipeline_batch_rows{stage}``: each stage's batches by their rows, in
    cumulative buckets of ``BATCH_ROWS_BUCKETS`` rows and ``+Inf``; the sum is every
    row the stage ran."""
    family = HistogramMetricFamily(
        "gguf_pipeline_batch_rows",
        "Rows of each batch (one worker call) a stage ran",
        labels=["stage"],
    )
    for stage in sorted(counts):
        rows = counts[stage]
        buckets = [
            (str(le), sum(n for r, n in rows.items() if r <= le)) for le in BATCH_ROWS_BUCKETS
        ]
        buckets.append(("+Inf", sum(rows.values())))
        total = sum(r * n for r, n in rows.items())
        family.add_metric([str(stage)], buckets, sum_value=total)
    return family


class Metrics:
    """The server's metrics. ``queued``, ``started`` (the choices started: running,
    and waiting for KV memory, read at once), ``ready``, ``restarts``, ``in_flight``,
    ``kv`` (each stage's ``(index, bytes, budget)``) and ``batches`` (each stage's
    batches by rows) are read when scraped."""

    def __init__(
        self,
        *,
        queued: Callable[[], int],
        started: Callable[[], tuple[int, int]],
        ready: Callable[[], bool],
        restarts: Callable[[], int],
        in_flight: Callable[[], int] = lambda: 0,
        kv: Callable[[], tuple[tuple[int, int, int], ...]] = lambda: (),
        batches: Callable[[], BatchCounts] = dict,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "gguf_pipeline_requests", "Requests by outcome", ("endpoint", "outcome"), registry=r
        )
        self.prompt_tokens = Counter(
            "gguf_pipeline_prompt_tokens", "Prompt tokens of answered requests", registry=r
        )
        self.completion_tokens = Counter(
            "gguf_pipeline_completion_tokens", "Tokens generated", registry=r
        )
        self.ttft = Histogram(
            "gguf_pipeline_time_to_first_token_seconds",
            "Arrival of a request to its first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "gguf_pipeline_time_per_output_token_seconds",
            "Time per token after the first",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        live = _Live(queued, started, ready, restarts, in_flight, kv, batches)
        r.register(live)
        for endpoint in ("chat", "completion"):
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)  # every series shows from the start

    def request(self, endpoint: str, outcome: str, *, prompt_tokens: int = 0) -> None:
        """A request ended (all its choices), with ``prompt_tokens`` when answered."""
        self.requests.labels(endpoint, outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)

    def generated(self, completion_tokens: int) -> None:
        """A choice not answered (its client left, the server stopped, a fault) was sent
        ``completion_tokens`` tokens."""
        self.completion_tokens.inc(completion_tokens)

    def answered(self, completion_tokens: int, ttft_s: float | None, tpot_s: float | None) -> None:
        """A choice was answered: its tokens, and its times (``None``: too few tokens)."""
        self.completion_tokens.inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RecoveryMetrics:
    """``gguf_pipeline_recoveries_total`` (streams replayed after a loss, each counted
    as its replay's first token arrives) and
    ``gguf_pipeline_recovery_seconds_total`` (their time from the interrupted run's end
    to the replay's first token), read when scraped."""

    def __init__(self, recoveries: Callable[[], Recoveries]) -> None:
        self.recoveries = recoveries

    def collect(self) -> Iterator[Metric]:
        r = self.recoveries()
        yield CounterMetricFamily(
            "gguf_pipeline_recoveries", "Streams replayed on a re-placed chain", r.count
        )
        yield CounterMetricFamily(
            "gguf_pipeline_recovery_seconds",
            "Seconds from a lost stage to the replay's first token, summed",
            r.seconds,
        )
