"""`dinfer-jax bench --server URL`: load test of a running `dinfer-jax serve` (or any OpenAI-compatible
server): `requests` chat completions from `concurrency` client threads; throughput and latency
percentiles, plus the server's own batching counters from /metrics when it has them."""
from __future__ import annotations

import concurrent.futures
import json
import re
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

import numpy as np


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


def run(base: str, prompts: Sequence[str | list[int]], *, requests: int, concurrency: int, model: str | None = None,
        max_tokens: int | None = None, timeout: float = 300.0) -> dict[str, Any]:
  base = base.rstrip("/").removesuffix("/v1")
  if model is None:
    try:
      model = json.loads(_get(base + "/v1/models", 30))["data"][0]["id"]
    except (urllib.error.URLError, OSError) as e:
      raise ValueError(f"--server {base}: cannot reach it ({getattr(e, 'reason', e)})") from None

  def one(i: int):
    p = prompts[i % len(prompts)]
    if isinstance(p, str):
      url, body = base + "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": p}]}
    else:
      url, body = base + "/v1/completions", {"model": model, "prompt": p}
    if max_tokens:
      body["max_tokens"] = max_tokens
    t = time.perf_counter()
    try:
      r = _post(url, body, timeout)
    except (urllib.error.URLError, OSError) as e:
      return time.perf_counter() - t, 0, str(e)
    return time.perf_counter() - t, int(r.get("usage", {}).get("completion_tokens", 0)), None

  before = scrape(base)
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
    results = list(ex.map(one, range(requests)))
  wall = time.perf_counter() - t0
  after = scrape(base)
  lat = np.array([r[0] for r in results if r[2] is None])
  toks = sum(r[1] for r in results)
  out = {"server": base, "model": model, "requests": requests, "concurrency": concurrency,
         "errors": sum(r[2] is not None for r in results), "wall_s": wall,
         "requests_per_s": len(lat) / wall, "tokens_per_s": toks / wall, "completion_tokens": toks,
         "latency_p50_s": float(np.percentile(lat, 50)) if lat.size else None,
         "latency_p99_s": float(np.percentile(lat, 99)) if lat.size else None,
         "latency_mean_s": float(lat.mean()) if lat.size else None}
  d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
  if d.get("dinfer_engine_calls_total"):
    out["engine_calls"] = int(d["dinfer_engine_calls_total"])
    out["mean_rows_per_call"] = d["dinfer_batch_rows_sum"] / d["dinfer_engine_calls_total"]
    out["tpf"] = d["dinfer_generated_tokens_total"] / max(d["dinfer_row_forwards_total"], 1)
  return out


def report(res: dict[str, Any]) -> str:
  lines = [f"server {res['server']} model {res['model']!r}: {res['requests']} requests, concurrency "
           f"{res['concurrency']}, {res['errors']} errors",
           f"  throughput {res['requests_per_s']:.1f} req/s, {res['tokens_per_s']:.1f} tokens/s "
           f"({res['completion_tokens']} tokens in {res['wall_s']:.2f}s)"]
  if res["latency_p50_s"] is not None:
    lines.append(f"  latency p50 {1000 * res['latency_p50_s']:.1f} ms, p99 {1000 * res['latency_p99_s']:.1f} ms, "
                 f"mean {1000 * res['latency_mean_s']:.1f} ms")
  if "engine_calls" in res:
    lines.append(f"  server: {res['engine_calls']} engine calls, {res['mean_rows_per_call']:.2f} rows per call, "
                 f"TPF {res['tpf']:.2f}")
  return "\n".join(lines)
