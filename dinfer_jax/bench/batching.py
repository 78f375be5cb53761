"""Window vs continuous batching under load: `python -m dinfer_jax.bench.batching [--json FILE]`.

Starts `dinfer-jax serve` twice on loopback (the embedded default model unless --model), --batching window
and --batching continuous, each warmed up before it is measured, and drives both with the same seeded
workload through `bench --server` (bench.server.run):
1. saturation: the window server's throughput in a closed loop with many clients (--concurrency);
2. open loop at Poisson arrival rates of 50%, 80% and 100% of that throughput, each rate against both
   servers one after the other (same requests, same arrival times), so the two are compared in one run.

The workload mixes short questions with long sums, all with one max_tokens (32: four blocks of 8), so
answers end after 1 to 4 blocks (early stop at EOS): the case batching per call handles worst, where a
row that is done waits for the slowest row of its call and a request that arrives waits for the whole
call.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import numpy as np

from dinfer_jax.bench import server as bench_server

SHORT = ("What is 348 + 279?", "What is 905 - 417?", "What is 61 * 7?", "f(0..5)=5,8,11,14,17,20",
         "f(0..5)=1,3,5,7,9,11", "What is 12 + 30?")


def workload(n: int, seed: int, long_share: float = 0.5) -> list[str]:
  """n chat prompts: long sums of two 15-18 digit numbers with probability long_share, else short ones."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    if rng.random() < long_share:
      a, b = (int(rng.integers(10**14, 10**18)) for _ in range(2))
      out.append(f"What is {a} + {b}?")
    else:
      out.append(SHORT[int(rng.integers(len(SHORT)))])
  return out


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Server:
  """A `dinfer-jax serve` subprocess; `start` returns once it is healthy and its warm-up is done."""

  def __init__(self, batching: str, *, model: str | None, max_batch: int, warmup_len: int, compile_cache: str | None):
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.cmd = [sys.executable, "-m", "dinfer_jax.cli", "serve", "--port", str(self.port), "--batching", batching,
                "--max-batch", str(max_batch), "--warmup-max-prompt-len", str(warmup_len),
                "--max-queue", "4096", "--timeout-s", "600"]
    if compile_cache:
      self.cmd += ["--compile-cache", compile_cache]
    if model:
      self.cmd += ["--model", model]
    self.proc: subprocess.Popen | None = None
    self.log: list[str] = []

  def start(self, timeout: float = 1800.0) -> "Server":
    self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1"))
    warm = threading.Event()

    def read():
      for line in self.proc.stdout:
        self.log.append(line.rstrip())
        if "warm-up done" in line:
          warm.set()
    threading.Thread(target=read, daemon=True).start()
    if not warm.wait(timeout) or self.proc.poll() is not None:
      self.stop()
      raise RuntimeError(f"server {' '.join(self.cmd)} did not warm up:\n" + "\n".join(self.log[-20:]))
    with urllib.request.urlopen(self.url + "/health", timeout=30) as r:
      assert json.loads(r.read())["status"] == "ok"
    return self

  def stop(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(30)
      except subprocess.TimeoutExpired:
        self.proc.kill()


def _point(res: dict[str, Any]) -> dict[str, Any]:
  keep = ("mode", "rate_rps", "concurrency", "sent", "errors", "throughput_rps", "tokens_per_s", "p50_s", "p99_s",
          "mean_s", "mean_rows_per_call", "tpf", "wall_s")
  return {k: res.get(k) for k in keep}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=None, help="model dir (default: the embedded default model)")
  p.add_argument("--max-batch", type=int, default=16)
  p.add_argument("--requests", type=int, default=240, help="requests per measured point (default %(default)s)")
  p.add_argument("--concurrency", type=int, default=64, help="clients of the saturation run (default %(default)s)")
  p.add_argument("--loads", default="0.5,0.8,1.0", help="open-loop rates as fractions of saturation")
  p.add_argument("--long-share", type=float, default=0.5, help="share of long sums in the workload")
  p.add_argument("--max-tokens", type=int, default=32,
                 help="max_tokens of every request (default %(default)s: one generation length for all, so "
                      "answers end after 1 to 4 blocks of 8; 0: each prompt's own default)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--warmup-max-prompt-len", type=int, default=64)
  p.add_argument("--compile-cache", default=None,
                 help="both servers' --compile-cache (default: the server's own, $XDG_CACHE_HOME/dinfer-jax/xla)")
  p.add_argument("--json", dest="json_out", default=None)
  args = p.parse_args(argv)
  loads = [float(x) for x in args.loads.split(",")]
  prompts = workload(args.requests, args.seed, args.long_share)
  say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

  servers = {}
  try:
    for kind in ("window", "continuous"):
      t = time.perf_counter()
      servers[kind] = Server(kind, model=args.model, max_batch=args.max_batch,
                             warmup_len=args.warmup_max_prompt_len, compile_cache=args.compile_cache).start()
      say(f"{kind} server up and warm in {time.perf_counter() - t:.0f}s")
    # Both servers once at low load first, so neither is measured with a cold path (first-call overheads).
    for kind, s in servers.items():
      bench_server.run(s.url, prompts[:16], requests=16, concurrency=4, max_tokens=args.max_tokens or None)
    sat = {kind: _point(bench_server.run(s.url, prompts, requests=args.requests, concurrency=args.concurrency,
                                         max_tokens=args.max_tokens or None))
           for kind, s in servers.items()}
    x_sat = sat["window"]["throughput_rps"]
    say(f"saturation (closed loop, {args.concurrency} clients): window {x_sat:.1f} req/s, continuous "
        f"{sat['continuous']['throughput_rps']:.1f} req/s")
    points = []
    for f in loads:
      rate = f * x_sat
      row = {"load": f, "rate_rps": rate}
      for kind, s in servers.items():
        row[kind] = _point(bench_server.run(s.url, prompts, requests=args.requests, rate=rate, seed=args.seed,
                                            max_tokens=args.max_tokens or None))
        say(f"load {f:.0%} ({rate:.1f}/s) {kind}: {row[kind]['throughput_rps']:.1f} req/s, "
            f"p50 {row[kind]['p50_s']:.3f}s, p99 {row[kind]['p99_s']:.3f}s")
      row["p99_continuous_over_window"] = row["continuous"]["p99_s"] / row["window"]["p99_s"]
      row["throughput_continuous_over_window"] = row["continuous"]["throughput_rps"] / row["window"]["throughput_rps"]
      points.append(row)
  finally:
    for s in servers.values():
      s.stop()
  out = {"requests_per_point": args.requests, "max_batch": args.max_batch, "long_share": args.long_share,
         "max_tokens": args.max_tokens, "command": " ".join(["python -m dinfer_jax.bench.batching"] + (argv or sys.argv[1:])),
         "seed": args.seed, "saturation_closed_loop": sat, "window_saturation_rps": x_sat, "points": points}
  print(report(out))
  if args.json_out:
    pathlib.Path(args.json_out).write_text(json.dumps(out, indent=1))
  return 0


def report(out: dict[str, Any]) -> str:
  lines = ["| load | rate (req/s) | batching | throughput (req/s) | p50 (s) | p99 (s) | rows/call |",
           "|---:|---:|---|---:|---:|---:|---:|"]
  for kind, r in out["saturation_closed_loop"].items():
    lines.append(f"| closed loop | - | {kind} | {r['throughput_rps']:.1f} | {r['p50_s']:.3f} | {r['p99_s']:.3f} | "
                 f"{r['mean_rows_per_call'] or 0:.2f} |")
  for row in out["points"]:
    for kind in ("window", "continuous"):
      r = row[kind]
      lines.append(f"| {row['load']:.0%} | {row['rate_rps']:.1f} | {kind} | {r['throughput_rps']:.1f} | "
                   f"{r['p50_s']:.3f} | {r['p99_s']:.3f} | {r['mean_rows_per_call'] or 0:.2f} |")
  return "\n".join(lines)


if __name__ == "__main__":
  raise SystemExit(main())
