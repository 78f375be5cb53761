"""Throughput bookkeeping with one set of counting rules (docs/design.md, D10), kept free of jax.

- tokens of a sequence: its generated tokens before the first EOS (engine.generate.count_generated);
- NFE: every model forward a call executes (a forward batched over rows counts once), refresh, prefill and
  vicinity warm-up forwards included; a row's TPF uses the forwards it took part in;
- TPS: tokens over the wall time of the call that produced them, after warm-up (compilation excluded);
  per-sequence TPS = T_i / t_call(i), reported as the mean over sequences (the paper's figure), and the
  aggregate = sum T_i / sum t_call (what batched serving cares about).
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Mapping, Sequence


@dataclasses.dataclass
class CallRecord:
  """One timed generate call (a batch of rows)."""
  wall_s: float  # wall time of the call after warm-up (median over repeats)
  num_tokens: list[int]  # per row: generated tokens before the first EOS
  row_nfe: list[int]  # per row: forwards it took part in
  nfe: int  # forwards the call executed
  forward_counts: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> count
  wall_min_s: float | None = None  # fastest of the repeats (the overhead compares best with best)
  compile_s: float = 0.0  # first call of a new shape minus the timed call (0 for a shape already seen)
  predicted_forward_s: float | None = None  # sum over kinds of count x time of one standalone forward
  predicted_device_s: float | None = None  # the same with forwards timed back to back in one program
  forward_s: dict[str, float] | None = None  # kind -> one standalone jitted forward (dispatch included)
  forward_device_s: dict[str, float] | None = None  # kind -> per forward, chained in one program


def summarize(calls: Sequence[CallRecord]) -> dict[str, float]:
  """Metrics of a run (a list of calls over the prompt set)."""
  if not calls:
    raise ValueError("summarize: no calls")
  per_seq_tps, per_seq_tpf = [], []
  tokens = 0
  for c in calls:
    if c.wall_s <= 0:
      raise ValueError(f"summarize: non-positive wall time {c.wall_s}")
    for t, f in zip(c.num_tokens, c.row_nfe):
      per_seq_tps.append(t / c.wall_s)
      per_seq_tpf.append(t / f if f else 0.0)
      tokens += t
  wall = sum(c.wall_s for c in calls)
  nfe = sum(c.nfe for c in calls)
  out = {
      "per_seq_tps_mean": statistics.fmean(per_seq_tps),
      "aggregate_tps": tokens / wall,
      "tpf": statistics.fmean(per_seq_tpf),
      "tpf_aggregate": tokens / nfe if nfe else 0.0,
      "fps": nfe / wall,
      "nfe": nfe,
      "tokens": tokens,
      "sequences": len(per_seq_tps),
      "wall_s": wall,
      "compile_s": sum(c.compile_s for c in calls),
  }
  # The overhead compares best with best (the fastest repeat of each call against best-of-N forward times):
  # on a shared machine both then estimate the uncontended time.
  best_wall = sum(c.wall_min_s if c.wall_min_s is not None else c.wall_s for c in calls)
  for key, attr in (("engine_overhead", "predicted_forward_s"), ("engine_overhead_device", "predicted_device_s")):
    predicted = [getattr(c, attr) for c in calls]
    out[key] = engine_overhead(best_wall, sum(predicted)) if all(p is not None for p in predicted) else None
  times = [c.forward_s for c in calls if c.forward_s]
  if times:
    out["forward_ms"] = {k: 1e3 * v for k, v in times[0].items()}
    out["forward_device_ms"] = {k: 1e3 * v for k, v in calls[0].forward_device_s.items()}
  return out


def predicted_forward_time(counts: Mapping[str, int], forward_s: Mapping[str, float]) -> float:
  """Time the call's forwards alone would take: sum over kinds of count x time of one forward of that kind."""
  missing = [k for k, n in counts.items() if n and k not in forward_s]
  if missing:
    raise ValueError(f"predicted_forward_time: no forward time for kind(s) {missing}")
  return sum(n * forward_s[k] for k, n in counts.items() if n)


def engine_overhead(wall_s: float, predicted_s: float) -> float:
  """Wall time of generate over the time its forwards alone take (1.0 = no cost outside the forwards)."""
  if predicted_s <= 0:
    raise ValueError(f"engine_overhead: non-positive forward time {predicted_s}")
  return wall_s / predicted_s


def ratio(a: float | None, b: float | None) -> float | None:
  if a is None or b is None or b == 0:
    return None
  return a / b
