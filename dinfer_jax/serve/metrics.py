"""The server's Prometheus metrics. The numbers are kept here, under one lock, as the event loop and the batcher's
thread update them; prometheus_client writes the exposition (names, label escaping, histogram lines) from a
registry of the server's own (not the process-wide default, so two apps in one process do not collide)."""
from __future__ import annotations

import bisect
import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


OTHER_ROUTE = "other"


class Histogram:
  def __init__(self, buckets):
    self.buckets = tuple(buckets)
    self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
    self.sum = 0.0
    self.n = 0

  def observe(self, v: float) -> None:
    self.counts[bisect.bisect_left(self.buckets, v)] += 1
    self.sum += v
    self.n += 1

  def family(self, name: str, help_: str) -> HistogramMetricFamily:
    acc, buckets = 0, []
    for b, c in zip(self.buckets + (float("inf"),), self.counts):
      acc += c
      buckets.append((floatToGoString(b), acc))
    return HistogramMetricFamily(name, help_, buckets=buckets, sum_value=self.sum)


class Metrics:
  """Counters, gauges and histograms the server updates from the event loop and the batcher's thread."""

  def __init__(self, max_batch: int):
    self._lock = threading.Lock()
    self._registry = CollectorRegistry(auto_describe=False)
    self._registry.register(self)
    self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count
    # The app's route paths: any other path a client sends counts as OTHER_ROUTE, so the labels stay bounded
    # whatever is requested (None: paths as given, for callers without routes).
    self.routes: frozenset[str] | None = None
    self.generated_tokens = 0
    self.row_forwards = 0  # forwards each row took part in, summed: tokens / row_forwards is TPF
    self.engine_forwards = 0  # forwards the engine executed (a batched forward counts once)
    self.engine_calls = 0
    self.dropped = 0
    self.queue_depth = lambda: 0
    self.prefix = lambda: None  # (engine.prefix_cache.PrefixStats, bytes in use), or None without the cache
    self.latency = Histogram(LATENCY_BUCKETS)
    self.engine_seconds = Histogram(LATENCY_BUCKETS)
    self.batch_rows = Histogram([b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= max_batch])

  def request(self, endpoint: str, status: int, seconds: float | None = None) -> None:
    if self.routes is not None and endpoint not in self.routes:
      endpoint = OTHER_ROUTE
    with self._lock:
      self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1
      if seconds is not None:
        self.latency.observe(seconds)

  def batch(self, stats) -> None:
    with self._lock:
      self.engine_calls += 1
      self.generated_tokens += stats.tokens
      self.row_forwards += stats.row_forwards
      self.engine_forwards += stats.nfe
      self.engine_seconds.observe(stats.seconds)
      self.batch_rows.observe(stats.rows)

  def drop(self, _job=None) -> None:
    with self._lock:
      self.dropped += 1

  def collect(self):
    """The metric families, read under the lock (prometheus_client's collector protocol)."""
    with self._lock:
      requests = CounterMetricFamily("dinfer_requests", "HTTP requests by endpoint and status code.",
                                     labels=["endpoint", "status"])
      for (ep, st), c in sorted(self.requests.items()):
        requests.add_metric([ep, str(st)], c)
      out = [requests]
      counters = [
          ("dinfer_generated_tokens", "Generated tokens before EOS.", self.generated_tokens),
          ("dinfer_row_forwards", "Forwards each row took part in, summed over rows.", self.row_forwards),
          ("dinfer_engine_forwards", "Forwards executed by the engine (batched ones count once).",
           self.engine_forwards),
          ("dinfer_engine_calls", "Batched engine calls.", self.engine_calls),
          ("dinfer_dropped_requests", "Requests dropped before running (client gone, timeout).", self.dropped),
      ]
      gauges = [
          ("dinfer_tokens_per_forward", "Generated tokens / row forwards since start (TPF).",
           self.generated_tokens / self.row_forwards if self.row_forwards else 0.0),
          ("dinfer_queue_depth", "Requests waiting to run.", self.queue_depth()),
      ]
      prefix = self.prefix()
      if prefix is not None:
        ps, used = prefix
        counters += [
            ("dinfer_prefix_cache_hit_blocks", "Prompt blocks whose K/V came from the prefix cache.", ps.hit_blocks),
            ("dinfer_prefix_cache_miss_blocks", "Prompt blocks looked up and not found.", ps.miss_blocks),
            ("dinfer_prefix_cache_evicted_blocks", "Blocks evicted (least recently used).", ps.evicted_blocks),
            ("dinfer_prefix_cache_prefills_saved", "Prefill forwards not run: every whole prompt block hit.",
             ps.prefills_saved),
        ]
        gauges.append(("dinfer_prefix_cache_bytes", "Device bytes the cached blocks take.", used))
      out += [CounterMetricFamily(name, help_, value=v) for name, help_, v in counters]
      out += [GaugeMetricFamily(name, help_, value=v) for name, help_, v in gauges]
      out += [self.latency.family("dinfer_request_latency_seconds", "Completion request latency."),
              self.engine_seconds.family("dinfer_engine_call_seconds", "Wall time of one batched engine call."),
              self.batch_rows.family("dinfer_batch_rows", "Rows per engine call.")]
    return out

  def render(self) -> str:
    return generate_latest(self._registry).decode()
