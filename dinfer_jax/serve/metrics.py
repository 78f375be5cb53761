"""Prometheus text exposition (format 0.0.4) for the server, without a client-library dependency."""
from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _escape(v: str) -> str:
  """A label value as the exposition format writes it: backslash, double quote and newline escaped."""
  return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
  if not labels:
    return ""
  return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


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

  def lines(self, name: str) -> list[str]:
    out, acc = [], 0
    for b, c in zip(self.buckets + (float("inf"),), self.counts):
      acc += c
      le = "+Inf" if b == float("inf") else repr(float(b))
      out.append(f'{name}_bucket{{le="{le}"}} {acc}')
    return out + [f"{name}_sum {self.sum}", f"{name}_count {self.n}"]


class Metrics:
  """Counters, gauges and histograms the server updates from the event loop and the batcher's thread."""

  def __init__(self, max_batch: int):
    self._lock = threading.Lock()
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

  def render(self) -> str:
    with self._lock:
      L = ["# HELP dinfer_requests_total HTTP requests by endpoint and status code.",
           "# TYPE dinfer_requests_total counter"]
      for (ep, st), c in sorted(self.requests.items()):
        L.append(f"dinfer_requests_total{_labels({'endpoint': ep, 'status': str(st)})} {c}")
      simple = [
          ("dinfer_generated_tokens_total", "counter", "Generated tokens before EOS.", self.generated_tokens),
          ("dinfer_row_forwards_total", "counter", "Forwards each row took part in, summed over rows.",
           self.row_forwards),
          ("dinfer_engine_forwards_total", "counter", "Forwards executed by the engine (batched ones count once).",
           self.engine_forwards),
          ("dinfer_engine_calls_total", "counter", "Batched engine calls.", self.engine_calls),
          ("dinfer_dropped_requests_total", "counter", "Requests dropped before running (client gone, timeout).",
           self.dropped),
          ("dinfer_tokens_per_forward", "gauge", "Generated tokens / row forwards since start (TPF).",
           self.generated_tokens / self.row_forwards if self.row_forwards else 0.0),
          ("dinfer_queue_depth", "gauge", "Requests waiting to run.", self.queue_depth()),
      ]
      prefix = self.prefix()
      if prefix is not None:
        ps, used = prefix
        simple += [
            ("dinfer_prefix_cache_hit_blocks_total", "counter", "Prompt blocks whose K/V came from the prefix cache.",
             ps.hit_blocks),
            ("dinfer_prefix_cache_miss_blocks_total", "counter", "Prompt blocks looked up and not found.",
             ps.miss_blocks),
            ("dinfer_prefix_cache_evicted_blocks_total", "counter", "Blocks evicted (least recently used).",
             ps.evicted_blocks),
            ("dinfer_prefix_cache_prefills_saved_total", "counter",
             "Prefill forwards not run: every whole prompt block hit.", ps.prefills_saved),
            ("dinfer_prefix_cache_bytes", "gauge", "Device bytes the cached blocks take.", used),
        ]
      for name, typ, help_, v in simple:
        L += [f"# HELP {name} {help_}", f"# TYPE {name} {typ}", f"{name} {v}"]
      for name, help_, h in (("dinfer_request_latency_seconds", "Completion request latency.", self.latency),
                             ("dinfer_engine_call_seconds", "Wall time of one batched engine call.",
                              self.engine_seconds),
                             ("dinfer_batch_rows", "Rows per engine call.", self.batch_rows)):
        L += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + h.lines(name)
    return "\n".join(L) + "\n"
