"""`dinfer-jax bench --server URL`: load test of a running `dinfer-jax serve` (or any OpenAI-compatible
server): `requests` chat completions, closed loop from `concurrency` client threads or open loop at
seeded Poisson arrival times (`--arrival poisson --rate R`); throughput and latency percentiles, plus the
server's own batching counters from /metrics when it has them."""
from __future__ import annotations

import concurrent.futures
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Sequence

import numpy as np

from dinfer_jax.serve.cli import is_loopback


def _post(url: str, body: dict, timeout: float) -> dict:
  req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=timeout) as r:
    return json.loads(r.read())


def _get(url: str, timeout: float) -> str:
  with urllib.request.urlopen(url, timeout=timeout) as r:
    return r.read().decode()


def scrape(base: str) -> dict[str, float]:
  """The un-labelled samples of /metrics (an empty dict when the server has none)."""
  try:
    text = _get(base + "/metrics", 10)
  except (urllib.error.URLError, OSError):
    return {}
  out = {}
  for line in text.splitlines():
    m = re.fullmatch(r"([a-z_]+) ([0-9.eE+-]+)", line)
    if m:
      out[m.group(1)] = float(m.group(2))
  return out


def _loopback(base: str) -> bool:

  return is_loopback(urllib.parse.urlsplit(base).hostname or "")


def arrival_times(rate: float, requests: int, seed: int) -> np.ndarray:
  """Poisson arrivals: send times (s from the start) with exponential gaps of mean 1/rate."""
  return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, size=requests))


def run(base: str, prompts: Sequence[str | list[int]], *, requests: int, concurrency: int | None = None,
        rate: float | None = None, seed: int = 0, max_duration_s: float = 600.0, model: str | None = None,
        max_tokens: int | None = None, timeout: float = 300.0) -> dict[str, Any]:
  """Closed loop (`concurrency` clients, each sending its next request when the last one is answered) or,
  with `rate`, open loop: requests sent at Poisson arrival times whatever the answers (seeded), latency
  counted from each request's scheduled send time, so a server that falls behind shows it as queueing.
  The open loop is loopback only and stops sending after max_duration_s (the rest count as not sent)."""
  base = base.rstrip("/").removesuffix("/v1")
  if (rate is None) == (concurrency is None):
    raise ValueError("bench --server: give either --concurrency (closed loop) or --arrival poisson --rate (open loop)")
  if rate is not None and not _loopback(base):
    raise ValueError(f"--server {base}: the open-loop load test only targets loopback addresses")
  if model is None:
    try:
      model = json.loads(_get(base + "/v1/models", 30))["data"][0]["id"]
    except (urllib.error.URLError, OSError) as e:
      raise ValueError(f"--server {base}: cannot reach it ({getattr(e, 'reason', e)})") from None

  t0 = 0.0
  sends = arrival_times(rate, requests, seed) if rate is not None else None

  def one(i: int):
    p = prompts[i % len(prompts)]
    if isinstance(p, str):
      url, body = base + "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": p}]}
    else:
      url, body = base + "/v1/completions", {"model": model, "prompt": p}
    if max_tokens:
      body["max_tokens"] = max_tokens
    if sends is not None:
      start = t0 + sends[i]
      if start - t0 > max_duration_s:
        return None  # past the time bound: not sent
      time.sleep(max(0.0, start - time.perf_counter()))
    else:
      start = time.perf_counter()
    try:
      r = _post(url, body, timeout)
    except (urllib.error.URLError, OSError) as e:
      return time.perf_counter() - start, 0, str(e)
    return time.perf_counter() - start, int(r.get("usage", {}).get("completion_tokens", 0)), None

  before = scrape(base)
  t0 = time.perf_counter()
  # Open loop: one thread per request in flight at most (the pool never delays a send it can make).
  workers = concurrency if sends is None else min(requests, 512)
  with concurrent.futures.ThreadPoolExecutor(workers) as ex:
    results = list(ex.map(one, range(requests)))
  wall = time.perf_counter() - t0
  after = scrape(base)
  sent = [r for r in results if r is not None]
  lat = np.array([r[0] for r in sent if r[2] is None])
  toks = sum(r[1] for r in sent)
  pct = lambda q: float(np.percentile(lat, q)) if lat.size else None  # noqa: E731
  out = {"server": base, "model": model, "requests": requests, "sent": len(sent),
         "mode": "closed" if sends is None else "open", "concurrency": concurrency,
         "arrival": None if sends is None else "poisson", "rate_rps": rate, "seed": seed if sends is not None else None,
         "errors": sum(r[2] is not None for r in sent), "wall_s": wall,
         "throughput_rps": len(lat) / wall, "tokens_per_s": toks / wall, "completion_tokens": toks,
         "p50_s": pct(50), "p99_s": pct(99), "mean_s": float(lat.mean()) if lat.size else None}
  # the names of earlier versions, kept for scripts that read them
  out.update(requests_per_s=out["throughput_rps"], latency_p50_s=out["p50_s"], latency_p99_s=out["p99_s"],
             latency_mean_s=out["mean_s"])
  d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
  if d.get("dinfer_engine_calls_total"):
    out["engine_calls"] = int(d["dinfer_engine_calls_total"])
    out["mean_rows_per_call"] = d["dinfer_batch_rows_sum"] / d["dinfer_engine_calls_total"]
    out["tpf"] = d["dinfer_generated_tokens_total"] / max(d["dinfer_row_forwards_total"], 1)
  if "dinfer_prefix_cache_hit_blocks_total" in after:
    hit, miss = d["dinfer_prefix_cache_hit_blocks_total"], d["dinfer_prefix_cache_miss_blocks_total"]
    out["prefix_cache"] = {"hit_blocks": int(hit), "miss_blocks": int(miss),
                           "hit_rate": hit / (hit + miss) if hit + miss else 0.0,
                           "prefills_saved": int(d["dinfer_prefix_cache_prefills_saved_total"]),
                           "evicted_blocks": int(d["dinfer_prefix_cache_evicted_blocks_total"])}
  return out


def report(res: dict[str, Any]) -> str:
  load = (f"concurrency {res['concurrency']}" if res["mode"] == "closed" else
          f"Poisson arrivals at {res['rate_rps']:g}/s (seed {res['seed']}), {res['sent']} sent")
  lines = [f"server {res['server']} model {res['model']!r}: {res['requests']} requests, {load}, "
           f"{res['errors']} errors",
           f"  throughput {res['requests_per_s']:.1f} req/s, {res['tokens_per_s']:.1f} tokens/s "
           f"({res['completion_tokens']} tokens in {res['wall_s']:.2f}s)"]
  if res["latency_p50_s"] is not None:
    lines.append(f"  latency p50 {1000 * res['latency_p50_s']:.1f} ms, p99 {1000 * res['latency_p99_s']:.1f} ms, "
                 f"mean {1000 * res['latency_mean_s']:.1f} ms")
  if "engine_calls" in res:
    lines.append(f"  server: {res['engine_calls']} engine calls, {res['mean_rows_per_call']:.2f} rows per call, "
                 f"TPF {res['tpf']:.2f}")
  if "prefix_cache" in res:
    pc = res["prefix_cache"]
    lines.append(f"  prefix cache: {pc['hit_blocks']} of {pc['hit_blocks'] + pc['miss_blocks']} prompt blocks hit "
                 f"({100 * pc['hit_rate']:.1f}%), {pc['prefills_saved']} prefill forwards saved, "
                 f"{pc['evicted_blocks']} blocks evicted")
  return "\n".join(lines)
