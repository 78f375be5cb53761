"""Side-by-side throughput of the jitted engine, the same algorithms stepped from Python, and the baselines.

Variants (same model, prompts and decoder settings, one process):
  engine        the jitted engine (the whole denoising loop as one XLA program) with the given config;
  stepped       the same config driven step by step from Python (engine.stepped with a JitRunner: one
                jitted forward per step, a host sync per step, as dInfer and Fast-dLLM run); batch 1;
  fixed_steps   LLaDA's fixed-steps low-confidence baseline, 1 token per forward, no cache (engine);
  fastdllm_dual Fast-dLLM's rule (top-1 + threshold) with the dual cache (engine);
  overhead      fixed_steps committing k tokens per forward with the config's cache (engine): fixed work
                per forward, so its engine overhead does not depend on the model's confidences.
Every engine variant also reports engine_overhead: generate's wall time over count x time of one standalone
jitted forward of each kind it ran (full / refresh, cached slice, block-diffusion prefill).
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dinfer_jax.bench.metrics import CallRecord, predicted_forward_time, summarize
from dinfer_jax.cache import KVCache
from dinfer_jax.config import ModelConfig
from dinfer_jax.engine import cache_policy, generate as gen_lib
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.generate import count_generated
from dinfer_jax.engine.stepped import JitRunner, stepped_generate
from dinfer_jax.model import params as params_lib
from dinfer_jax.model.transformer import forward

VARIANTS = ("engine", "stepped", "fixed_steps", "fastdllm_dual", "overhead")

# Built-in prompts: questions for a model with a tokenizer (the default model's tasks: arithmetic and
# guess-the-function), token ids otherwise.
TEXT_PROMPTS = ("What is 348 + 279?", "12*3", "What is 905 - 417?", "f(0..5)=5,8,11,14,17,20",
                "What is 61 * 7?", "f(0..5)=1,3,5,7,9,11")


def default_token_prompts(mcfg: ModelConfig, mask_id: int, eos_id: int, n: int = 4) -> list[list[int]]:
  """n deterministic random prompts of lengths 12, 20, 28, ... avoiding the mask and EOS ids."""
  rng = np.random.default_rng(0)
  hi = min(mcfg.vocab_size, 32000)
  out = []
  for i in range(n):
    ids = [int(t) for t in rng.integers(0, hi, size=12 + 8 * i)]
    out.append([t if t not in (mask_id, eos_id) else (t + 1) % hi for t in ids])
  return out


def variant_config(name: str, gcfg: GenerationConfig, *, overhead_k: int = 4,
                   overhead_gen_length: int = 0) -> GenerationConfig:
  """The GenerationConfig a variant runs with. The overhead probe runs without early stop (fixed work per
  call, whatever the model), optionally with its own gen_length (more forwards per call amortise the
  per-call host costs that a very short generation would show)."""
  if name in ("engine", "stepped"):
    return gcfg
  plain = dict(cont_weight=0.0, prefix_look=0, after_look=0, warmup_steps=0)
  if name == "fixed_steps":
    return gcfg.replace(decoder="fixed_steps", steps_per_block=gcfg.block_length, cache="none", **plain)
  if name == "fastdllm_dual":
    return gcfg.replace(decoder="fastdllm", steps_per_block=0, cache="dual", **plain)
  if name == "overhead":
    k = max(1, min(overhead_k, gcfg.block_length))
    G = overhead_gen_length or gcfg.gen_length
    G = -(-G // gcfg.block_length) * gcfg.block_length  # fixed_steps needs whole blocks
    return gcfg.replace(decoder="fixed_steps", steps_per_block=max(1, gcfg.block_length // k), cont_weight=0.0,
                        early_stop=False, gen_length=G)
  raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
  times, out = _times(fn, repeats)
  return statistics.median(times), out


def _times(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
  times, out = [], None
  for _ in range(repeats):
    t = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t)
  return times, out


def _best_time(fn: Callable[[], Any], reps: int) -> float:
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t)
  return best


# ----------------------------------------------------------------------------- standalone forwards

def _chained(f, n: int):
  """f(p, inp, *rest) -> n calls of f in one program, each call's input depending on the previous output.
  Everything but the params and inputs is passed as an argument, never closed over, so XLA cannot
  constant-fold positions or masks into a cheaper forward than the engine's."""
  if not n:
    return jax.jit(f)

  def many(p, inp, *rest):
    def body(_, carry):
      x, acc = carry
      y = f(p, x, *rest)
      # Never true; a dependence on every output (logits and K/V) that XLA cannot drop.
      bump = sum((jnp.max(leaf).astype(jnp.float32) > 3e38).astype(jnp.int32) for leaf in jax.tree_util.tree_leaves(y))
      x = jax.tree_util.tree_map(lambda a: a + bump.astype(a.dtype), x)
      return x, acc + bump
    return jax.lax.fori_loop(0, n, body, (inp, jnp.int32(0)))[1]
  return jax.jit(many)


def cached_kind(windows: tuple[int, ...], width: int) -> str:
  """Name of the cached forward of this window width (windows: layout.Grid.windows): "cached" (the widest),
  "cached@<width>" otherwise."""
  return "cached" if not windows or width == windows[0] else f"cached@{width}"


def forward_programs(mcfg: ModelConfig, gcfg: GenerationConfig, lay, prog, *, table=None,
                     abstract_dtype=None, cache_out: bool = False) -> dict[str, tuple[Callable[..., Any], tuple]]:
  """Per kind of forward the engine runs for this layout: (f, args), f(params, *args) a pure forward of
  exactly the shape the engine's program uses (same batch, canvas, window, logits slice, masks).

  table: the embedding table (smoothing feeds embeddings; only its shape/dtype is used when abstract).
  abstract_dtype: None builds concrete args; a dtype builds jax.ShapeDtypeStruct args (the cache in that
  dtype) for ahead-of-time compiles without materialising the [layers, B, S, K, H] cache.
  cache_out: the cached forwards also return the cache (argument 2; prefix/dual: restored in place, as the
  engine's loop carries it), for a compile that donates it (the roofline bench); without it they return
  only the logits, and XLA copies the non-donated cache before writing into it (CPU timings)."""
  grid, mode = lay.grid, prog.cache.name
  L, C, W, Tc = grid.block_len, grid.first_block, grid.window, grid.canvas_len
  Bsz = grid.batch
  canvas = jnp.asarray(lay.canvas)
  valid = jnp.asarray(lay.valid)
  pos = jnp.asarray(lay.positions)
  smoothing = gcfg.smoothing
  progs: dict[str, tuple[Callable[..., Any], tuple]] = {}
  dt = abstract_dtype if abstract_dtype is not None else table.dtype

  def inputs(x):
    if not smoothing:
      return {"tokens": x}
    if abstract_dtype is not None:
      return {"embeds": jax.ShapeDtypeStruct(x.shape + (mcfg.d_model,), dt)}
    return {"embeds": jnp.take(table, x, axis=0)}

  if mode != "block_diffusion":
    mask = prog.cache.full_mask(valid, L)
    # As engine.loop's full forward: the block's logits, or with smoothing the generation region's (from C).
    full_lg = {"logits_len": Tc - C} if smoothing else {"logits_len": L}
    keep_kv = mode in ("prefix", "dual")  # a refresh forward's K/V go into the cache: keep them live

    def full_fwd(p, inp, ps, m, s):
      out = forward(p, mcfg, positions=ps, mask=m, logits_start=s, **inp, **full_lg)
      return (out.logits, out.kv) if keep_kv else out.logits
    progs["full"] = (full_fwd, (inputs(canvas), pos, mask, jnp.int32(C)))
  if mode in ("prefix", "dual", "block_diffusion"):
    c0 = C if mode == "block_diffusion" else int(min(max(C - gcfg.prefix_look, 0), Tc - W))
    if mode == "prefix":
      c0 = C
    # The engine's layout: one buffer per layer.
    if abstract_dtype is not None:
      layers = tuple(jax.ShapeDtypeStruct((Bsz, Tc, mcfg.n_kv_heads, mcfg.head_dim), dt)
                     for _ in range(mcfg.n_layers))
      cache = KVCache(k=layers, v=layers)
    else:
      cache = KVCache.zeros(mcfg.n_layers, Bsz, Tc, mcfg.n_kv_heads, mcfg.head_dim, dt, per_layer=True)
    write = jnp.ones((Bsz, W), bool)
    cached_lg = {} if smoothing else {"logits_len": L}
    keep = mode != "block_diffusion"

    def cached_fwd(p, inp, kv, ps, m, wm, c, s):
      out = forward(p, mcfg, positions=ps, mask=m, cache=kv, cache_start=c, write_mask=wm, logits_start=s,
                    keep_cache=keep, **inp, **cached_lg)
      return (out.logits, out.kv) if cache_out else out.logits
    progs["cached"] = (cached_fwd, (inputs(canvas[:, c0:c0 + W]), cache, pos[:, c0:c0 + W], valid, write,
                                    jnp.int32(c0), jnp.int32(C - c0)))
    # The prefix cache's narrower windows (grid.windows), each at the last block it serves.
    for w in grid.windows[1:]:
      c0 = Tc - w
      progs[cached_kind(grid.windows, w)] = (cached_fwd, (inputs(canvas[:, c0:]), cache, pos[:, c0:], valid,
                                                  jnp.ones((Bsz, w), bool), jnp.int32(c0), jnp.int32(w - L)))
  if mode == "block_diffusion" and prog.cache.cross_block and Tc >= 2 * L:
    # The cross-block update (dInfer v0.2): the block entry's forward over the previous block and this one, each
    # query seeing the blocks up to its own, both blocks' K/V returned; the current block's logits.
    c0 = C
    cross_mask = cache_policy.block_causal_mask(valid, c0 + jnp.arange(2 * L), L)
    progs["cross"] = (cached_fwd, (inputs(canvas[:, c0:c0 + 2 * L]), cache, pos[:, c0:c0 + 2 * L], cross_mask,
                                   jnp.ones((Bsz, 2 * L), bool), jnp.int32(c0), jnp.int32(L)))
  if mode == "block_diffusion":
    P = grid.prefill_len
    bc = cache_policy.block_causal_mask(valid[:, :P], jnp.arange(P), L)
    progs["prefill"] = (lambda p, inp, ps, m: forward(p, mcfg, positions=ps, mask=m, **inp).kv,
                        ({"tokens": canvas[:, :P]}, pos[:, :P], bc))
  return progs


def forward_fns(params, mcfg: ModelConfig, gcfg: GenerationConfig, lay, prog, *,
                chain: int = 0) -> dict[str, Callable[[], Any]]:
  """One zero-argument callable per kind of forward the engine runs for this layout (forward_programs),
  each jitted. chain=n: each callable runs n such forwards back to back in one program instead."""
  fns: dict[str, Callable[[], Any]] = {}
  params = gen_lib.engine_params(params)  # the layout the engine's program runs on
  for kind, (f, args) in forward_programs(mcfg, gcfg, lay, prog, table=params["embed"]).items():
    jf = _chained(f, chain)
    fns[kind] = functools.partial(jf, params, *args)
  return fns


def time_forwards(params, mcfg, gcfg, lay, prog, reps: int = 5) -> dict[str, float]:
  """Best-of-reps seconds of one standalone jitted forward per kind (compiled before timing), each call
  dispatched from Python and waited for with block_until_ready."""
  return {k: _best_time(fn, reps) for k, fn in forward_fns(params, mcfg, gcfg, lay, prog).items()}


def time_forwards_chained(params, mcfg, gcfg, lay, prog, n: int = 8, reps: int = 3) -> dict[str, float]:
  """Seconds per forward when n forwards of a kind run back to back inside one jitted program (a data
  dependence between them keeps XLA from hoisting or merging them): the forward's device time without
  the per-call dispatch, which dominates on tiny models."""
  out = {}
  for k, fn in forward_fns(params, mcfg, gcfg, lay, prog, chain=n).items():
    out[k] = _best_time(fn, reps) / n
  return out


def engine_counts(out_counts: dict[str, int], nfe: int, grid=None,
                  cached_windows: dict[int, int] | None = None) -> dict[str, int]:
  """forward_counts {"full", "cached"} plus the prefill forwards (the rest of the NFE); with the prefix
  cache's windows (GenerationResult.cached_windows) the cached forwards split by width (cached_kind)."""
  counts = dict(out_counts)
  counts["prefill"] = nfe - sum(out_counts.values())
  if cached_windows:
    del counts["cached"]
    counts.update({cached_kind(grid.windows, w): n for w, n in cached_windows.items()})
  return counts


# ----------------------------------------------------------------------------- runs

def run_engine(params, mcfg: ModelConfig, batches: Sequence[Sequence[Sequence[int]]], gcfg: GenerationConfig, *,
               repeats: int = 3, overhead: bool = True, forward_reps: int = 10, tick: Callable[[], None] = lambda: None,
               mesh=None) -> list[CallRecord]:
  """Runs every batch through the jitted engine: one untimed first call per new shape bucket (compile),
  then `repeats` timed calls (median); with overhead=True also times the standalone forwards per shape."""
  seen: dict[Any, dict[str, float] | None] = {}
  records = []

  def call(batch):
    lay, out, prog = gen_lib.generate_arrays(params, mcfg, batch, gcfg)
    jax.block_until_ready(out)
    return gen_lib.collect(lay, out, len(batch), prog.stop_ids), lay, prog

  for batch in batches:
    lay0, prog0 = gen_lib.prepare(mcfg, batch, gcfg)
    key = lay0.grid
    first_s = None
    if key not in seen:
      t = time.perf_counter()
      call(batch)
      first_s = time.perf_counter() - t
      seen[key] = ((time_forwards(params, mcfg, gcfg, lay0, prog0, forward_reps),
                    time_forwards_chained(params, mcfg, gcfg, lay0, prog0)) if overhead else None)
    tick()
    times, (res, lay, prog) = _times(lambda: call(batch), repeats)
    wall = statistics.median(times)
    for _ in range(repeats):
      tick()
    if overhead and repeats < forward_reps:
      # The overhead compares the fastest call with the fastest of forward_reps standalone forwards: take
      # as many samples of the call, so that neither minimum is luckier on a noisy machine.
      times += _times(lambda: call(batch), forward_reps - repeats)[0]
    counts = engine_counts(res.forward_counts, res.nfe, lay.grid, res.cached_windows)
    fwd = seen[key]
    records.append(CallRecord(
        wall_s=wall, wall_min_s=min(times), num_tokens=list(res.num_tokens), row_nfe=list(res.row_nfe), nfe=res.nfe,
        forward_counts=counts, compile_s=max(0.0, first_s - wall) if first_s is not None else 0.0,
        predicted_forward_s=predicted_forward_time(counts, fwd[0]) if fwd is not None else None,
        predicted_device_s=predicted_forward_time(counts, fwd[1]) if fwd is not None else None,
        forward_s=fwd[0] if fwd is not None else None, forward_device_s=fwd[1] if fwd is not None else None))
  return records


def run_stepped(params, mcfg: ModelConfig, prompts: Sequence[Sequence[int]], gcfg: GenerationConfig, *,
                repeats: int = 3, tick: Callable[[], None] = lambda: None) -> list[CallRecord]:
  """Runs every prompt (batch 1) through the Python-stepped loop: one untimed call per prompt first (it
  compiles every forward shape that prompt needs; jax.jit caches them), then `repeats` timed calls."""
  runner = JitRunner()
  eos = gcfg.stop_ids(mcfg)
  records = []
  for p in prompts:
    t = time.perf_counter()
    stepped_generate(params, mcfg, list(p), gcfg, runner=runner)
    first_s = time.perf_counter() - t
    tick()
    wall, res = _median_time(lambda: stepped_generate(params, mcfg, list(p), gcfg, runner=runner), repeats)
    for _ in range(repeats):
      tick()
    gen = res.canvas[len(p):len(p) + gcfg.gen_length]
    kinds = {}
    for kind, _, _ in res.forwards:
      kinds[kind] = kinds.get(kind, 0) + 1
    records.append(CallRecord(wall_s=wall, num_tokens=[count_generated(gen, eos)], row_nfe=[res.nfe], nfe=res.nfe,
                              forward_counts=kinds, compile_s=max(0.0, first_s - wall)))
  return records


def batched(prompts: Sequence[Sequence[int]], batch_size: int) -> list[list[list[int]]]:
  return [list(map(list, prompts[i:i + batch_size])) for i in range(0, len(prompts), batch_size)]


def run_side_by_side(params, mcfg: ModelConfig, prompts: Sequence[Sequence[int]], gcfg: GenerationConfig, *,
                     batch_size: int = 1, repeats: int = 3, variants: Sequence[str] = VARIANTS,
                     overhead_k: int = 4, overhead_gen_length: int = 0, progress: bool = True) -> dict[str, Any]:
  """Runs the variants on the same prompts; returns {"variants": {name: metrics}, ratios...}."""

  batches = batched(prompts, batch_size)
  # Each loop on the layout it is written for, made once (not inside a timed call): the engine on per-layer
  # buffers, the Python-stepped baseline on the stacked layers that dInfer's modules scan.
  engine_p, stepped_p = gen_lib.engine_params(params), params_lib.stack_layers(params)
  units = 0
  for v in variants:
    units += (len(prompts) if v == "stepped" else len(batches)) * (1 + repeats)
  bar = tqdm(total=units, desc="bench", disable=not progress, leave=False)
  results: dict[str, Any] = {}
  try:
    for v in variants:
      vcfg = variant_config(v, gcfg, overhead_k=overhead_k, overhead_gen_length=overhead_gen_length)
      bar.set_postfix_str(v)
      if v == "stepped":
        recs = run_stepped(stepped_p, mcfg, prompts, vcfg, repeats=repeats, tick=lambda: bar.update(1))
      else:
        recs = run_engine(engine_p, mcfg, batches, vcfg, repeats=repeats, tick=lambda: bar.update(1))
      m = summarize(recs)
      m.update(decoder=vcfg.decoder, cache=vcfg.cache, smoothing=vcfg.smoothing, vicinity=vcfg.vicinity,
               steps_per_block=vcfg.steps_per_block, gen_length=vcfg.gen_length, early_stop=vcfg.early_stop,
               batch_size=1 if v == "stepped" else batch_size,
               forward_counts=_sum_counts(recs))
      results[v] = m
  finally:
    bar.close()
  return results


def _sum_counts(recs: Sequence[CallRecord]) -> dict[str, int]:
  out: dict[str, int] = {}
  for r in recs:
    for k, n in r.forward_counts.items():
      out[k] = out.get(k, 0) + n
  return out
