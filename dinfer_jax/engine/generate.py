"""Host side of generation: prompts -> canvas layout -> one jitted program -> per-row results."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import decoders, sharding
from dinfer_jax.config import ModelConfig
from dinfer_jax.engine import loop
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.layout import Layout, make_layout, normalize_prompts, round_up
from dinfer_jax.model import moe
from dinfer_jax.model import params as params_lib
from dinfer_jax.sharding import use_mesh


@dataclasses.dataclass
class GenerationResult:
  """Per-row results of one generate call.

  tokens: generated tokens before the first EOS (what a user reads, and what TPS counts).
  canvas: prompt followed by every generated position (after the early-stop EOS fill), no padding.
  commit_step: per generated position, the row's 1-based forward index that committed it; -1 = never
    (filled by early stop).
  num_tokens: len(tokens) per row. nfe: model forwards executed by the call (a forward batched over rows
    counts once). row_nfe: forwards each row took part in (equals its NFE when run alone).
  forward_counts: {"full": refresh/full forwards, "cached": cached forwards}.
  cached_windows: prefix cache only: the cached forwards per window width (its windows shrink with the
    block, layout.Grid.windows), {width: forwards}; empty otherwise.
  """
  tokens: list[list[int]]
  canvas: list[list[int]]
  commit_step: list[list[int]]
  num_tokens: list[int]
  nfe: int
  row_nfe: list[int]
  prompt_lengths: list[int]
  forward_counts: dict[str, int]
  cached_windows: dict[int, int] = dataclasses.field(default_factory=dict)


def count_generated(generated: Sequence[int], eos_id: int) -> int:
  """The token counter for TPS/TPF (decoding.md Decisions §8): generated tokens before the first EOS."""
  for i, t in enumerate(generated):
    if t == eos_id:
      return i
  return len(generated)


def decoder_for(gcfg: GenerationConfig, vocab_size: int):
  """The decoder policy object (static in the compiled program) for a generation config."""
  if gcfg.decoder == "threshold":
    return decoders.ThresholdDecoder(threshold=gcfg.threshold)
  if gcfg.decoder == "hierarchy":
    return decoders.HierarchyDecoder(threshold=gcfg.threshold, low_threshold=gcfg.low_threshold)
  if gcfg.decoder == "credit":
    return decoders.CreditDecoder(threshold=gcfg.threshold, alpha=gcfg.credit_alpha, gamma=gcfg.credit_gamma,
                                  beta=gcfg.credit_beta, vocab_size=vocab_size)
  if gcfg.decoder == "fixed_steps":
    return decoders.FixedStepsDecoder(steps_per_block=gcfg.steps_per_block)
  return decoders.FastDLLMDecoder(threshold=gcfg.threshold)


def engine_mode(mcfg: ModelConfig, gcfg: GenerationConfig) -> tuple[str, bool]:
  """(mode, block_causal). LLaDA2 decodes by block diffusion (decoding.md §6d): with any cache the
  block-diffusion prefix cache, without one full forwards under the block-causal mask."""
  if mcfg.family == "llada2_moe":
    if gcfg.smoothing:
      raise ValueError("GenerationConfig.cont_weight: iteration smoothing is not supported with LLaDA2's "
                       "block diffusion; set cont_weight=0")
    if gcfg.vicinity:
      raise ValueError("GenerationConfig.prefix_look/after_look/warmup_steps: the vicinity refresh does not "
                       "apply to LLaDA2's block diffusion (its cache is exact); set them to 0")
    return ("none", True) if gcfg.cache == "none" else ("block_diffusion", False)
  return gcfg.cache, False


def bucket_rows(n: int) -> int:
  """Rows of the compiled program for n prompts: powers of two up to 16, then multiples of 16, so a new
  batch size reuses a compiled program (the extra rows stay invalid: they never decode and cost no NFE)."""
  if n <= 16:
    return 1 << (n - 1).bit_length()
  return -(-n // 16) * 16


def prepare(mcfg: ModelConfig, prompts, gcfg: GenerationConfig, *,
            batch_bucket: int | None = None, row_multiple: int = 1) -> tuple[Layout, dict[str, Any]]:
  """Validates and lays out the prompts; returns the layout and the static arguments of the program.
  batch_bucket: run at this many rows (default bucket_rows(len(prompts))); the extra rows are invalid.
  row_multiple: the canvas gets a multiple of this many rows (the data-parallel width: every device takes
  an equal share; the added rows are invalid and never decode)."""
  mode, block_causal = engine_mode(mcfg, gcfg)
  prompts = normalize_prompts(prompts)
  if batch_bucket is not None and batch_bucket < len(prompts):
    raise ValueError(f"generate: batch_bucket={batch_bucket} is smaller than the {len(prompts)} prompts")
  rows = round_up(batch_bucket or bucket_rows(len(prompts)), row_multiple)
  lay = make_layout(prompts, gcfg, mcfg, block_diffusion=block_causal or mode == "block_diffusion",
                    batch_bucket=rows)
  mask_id = gcfg.mask_id if gcfg.mask_id is not None else mcfg.mask_token_id
  eos_id = gcfg.eos_id if gcfg.eos_id is not None else mcfg.eos_token_id
  static = dict(mcfg=mcfg, gcfg=gcfg, grid=lay.grid, decoder=decoder_for(gcfg, mcfg.vocab_size), mode=mode,
                block_causal=block_causal, mask_id=int(mask_id), eos_id=int(eos_id))
  return lay, static


def program(static: dict[str, Any], vocab_size: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(static arguments of the shared program, runtime knobs) for prepare's static arguments: the program is
  compiled for gcfg.program_config() and takes the thresholds, temperature and smoothing cap as traced
  values, so configs that differ only in those reuse one compiled program."""
  gcfg = static["gcfg"]
  prog = gcfg.program_config()
  return dict(static, gcfg=prog, decoder=decoder_for(prog, vocab_size)), gcfg.knob_values()


_LAST_UNSTACKED: list = []  # [(stacked params, mesh, their per-layer layout)]: the last params generate saw


def inference_params(params: dict, mcfg: ModelConfig | None = None, mesh: jax.sharding.Mesh | None = None) -> dict:
  """The per-layer layout the program runs on (params_lib.unstack_layers), made once per params object
  (and mesh, where its leaves are placed as the logical-axis rules say): the last one is kept next to the
  stacked params (weights memory x2) so repeated calls reuse it."""
  if params_lib.is_unstacked(params):
    return params
  if _LAST_UNSTACKED and _LAST_UNSTACKED[0][0] is params and _LAST_UNSTACKED[0][1] is mesh:
    return _LAST_UNSTACKED[0][2]
  un = params_lib.unstack_layers(params)
  if mesh is not None:
    un = jax.device_put(un, unstacked_shardings(un, mcfg, mesh))
  _LAST_UNSTACKED[:] = [(params, mesh, un)]
  return un


def unstacked_shardings(un: dict, mcfg: ModelConfig, mesh: jax.sharding.Mesh) -> dict:
  """NamedShardings of the per-layer layout: each layer's leaves keep their logical axes minus "layers"."""
  axes = params_lib.logical_axes(mcfg)
  is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
  for name in params_lib.LAYER_GROUPS:
    if name in axes:
      per_layer = jax.tree_util.tree_map(lambda ax: ax[1:], axes[name], is_leaf=is_axes)
      axes[name] = [per_layer] * len(un[name])
  return sharding.param_shardings(un, axes, mesh)


def generate_arrays(params: dict, mcfg: ModelConfig, prompts, gcfg: GenerationConfig, *, seed: int = 0,
                    batch_bucket: int | None = None, on_block=None, mesh: jax.sharding.Mesh | None = None,
                    programs=None):
  """Runs the program; returns (layout, device outputs) without host post-processing (for benchmarks).
  on_block(block_index, rows_tokens): see generate. With a mesh the program runs with explicit in/out
  shardings (see sharded_run). programs: an engine.programs.ProgramCache to take the program from (and
  keep it in) instead of jit's own unbounded cache; not with a mesh."""
  lay, static = prepare(mcfg, prompts, gcfg, batch_bucket=batch_bucket, row_multiple=sharding.data_size(mesh))
  prog, knobs = program(static, mcfg.vocab_size)
  params = inference_params(params, mcfg, mesh)
  if mesh is not None:
    if programs is not None:
      raise ValueError("generate: a ProgramCache is not supported together with a mesh yet")
    if on_block is not None:
      raise ValueError("generate: streaming (on_block) is not supported together with a mesh yet")
    leaves, treedef = jax.tree_util.tree_flatten(unstacked_shardings(params, mcfg, mesh))
    rows = sharding.row_sharded(mesh, lay.canvas.shape)
    arrays = [sharding.put_global(a, rows) for a in (lay.canvas, lay.valid, lay.positions)]
    with use_mesh(mesh), moe.partitioned(mesh.size > 1):
      repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      key = sharding.put_global(np.asarray(jax.random.PRNGKey(seed)), repl)
      knobs = {k: sharding.put_global(np.asarray(v), repl) for k, v in knobs.items()}
      out = sharded_run(mesh, treedef, tuple(leaves), tuple(sorted(prog.items())))(params, *arrays, key, knobs)
    return lay, out, static
  args = (params, jnp.asarray(lay.canvas), jnp.asarray(lay.valid), jnp.asarray(lay.positions),
          jax.random.PRNGKey(seed), knobs)
  stream = on_block is not None
  if programs is None:
    run = functools.partial(loop.run_jit(), **prog, **(dict(stream=True) if stream else {}))
  else:
    run = programs.get(program_key(prog, lay, stream), lambda: _compile(args, prog, stream))
  if not stream:
    return lay, run(*args), static
  sid = loop.register_stream(_row_tokens_callback(lay, len(normalize_prompts(prompts)), static["eos_id"], on_block))
  try:
    out = jax.block_until_ready(run(*args, stream_id=jnp.int32(sid)))
  finally:
    loop.unregister_stream(sid)
  return lay, out, static


def program_key(prog: dict[str, Any], lay: Layout, stream: bool) -> tuple:
  """A compiled program's identity in a ProgramCache (one cache per model: the params' shapes are fixed):
  its static arguments, the canvas shape and whether it streams."""
  return (tuple(sorted(prog.items())), lay.canvas.shape, stream)


def _compile(args: tuple, prog: dict[str, Any], stream: bool):
  """loop.run compiled ahead of time for these arguments' shapes (the values are not read)."""
  extra = dict(stream=True, stream_id=jnp.int32(0)) if stream else {}
  return loop.run_jit().lower(*args, **prog, **extra).compile()


def _program_args(params, mcfg: ModelConfig, prompts, gcfg: GenerationConfig, batch_bucket: int | None):
  lay, static = prepare(mcfg, prompts, gcfg, batch_bucket=batch_bucket)
  prog, knobs = program(static, mcfg.vocab_size)
  abstract = lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype)  # noqa: E731
  args = (inference_params(params, mcfg), *(abstract(a) for a in (lay.canvas, lay.valid, lay.positions)),
          abstract(jax.random.PRNGKey(0)), {k: abstract(v) for k, v in knobs.items()})
  return lay, prog, args


def program_ready(programs, model, prompts, gcfg: GenerationConfig, *, batch_bucket: int | None = None,
                  stream: bool = False) -> bool:
  """Whether `programs` holds the program generate(model, prompts, gcfg, ...) would run (nothing compiles)."""
  mcfg = model.config if hasattr(model, "params") else model[1]
  lay, static = prepare(mcfg, prompts, gcfg, batch_bucket=batch_bucket)
  return programs.ready(program_key(program(static, mcfg.vocab_size)[0], lay, stream))


def compile_program(programs, model, prompts, gcfg: GenerationConfig, *, batch_bucket: int | None = None,
                    stream: bool = False) -> bool:
  """Puts into `programs` the program generate(model, prompts, gcfg, ...) would run, compiled without running
  it. Returns whether it had to be built."""
  params, mcfg = (model.params, model.config) if hasattr(model, "params") else model
  lay, prog, args = _program_args(params, mcfg, prompts, gcfg, batch_bucket)
  key = program_key(prog, lay, stream)
  if programs.ready(key):
    return False
  programs.get(key, lambda: _compile(args, prog, stream))
  return True


def committed_tokens(canvas_row: np.ndarray, start: int, end: int, upto: int, eos_id: int) -> list[int]:
  """A row's generated tokens (canvas [start, end)) committed before canvas index `upto`, cut at the first
  EOS: what streaming hands out after each block."""
  end = min(end, upto)
  gen = canvas_row[start:end].tolist() if end > start else []
  return gen[:count_generated(gen, eos_id)]


def _row_tokens_callback(lay: Layout, n_rows: int, eos_id: int, on_block):
  """Turns the engine's per-block canvas into each row's generated tokens committed so far (up to the
  block's end, before the first EOS)."""
  C, L = lay.grid.first_block, lay.grid.block_len

  def emit(k: int, canvas: np.ndarray) -> None:
    upto = C + (k + 1) * L
    on_block(k, [committed_tokens(canvas[r], int(lay.pad[r] + lay.prompt_len[r]), int(lay.end[r]), upto, eos_id)
                 for r in range(n_rows)])
  return emit


@functools.cache
def sharded_run(mesh: jax.sharding.Mesh, param_treedef, param_leaf_shardings: tuple, static: tuple):
  """The generation program with explicit shardings: params as the logical-axis rules place them; canvas,
  valid, positions and the per-row outputs split by batch rows on "data"; counters replicated. On
  accelerators the canvas and positions buffers are donated (they alias the canvas and commit outputs).
  static: loop.run's static arguments as sorted (name, value) pairs (bound here: jit takes no keyword
  arguments once in_shardings are given), so one compiled program per mesh, param layout and shape bucket."""
  p_sh = jax.tree_util.tree_unflatten(param_treedef, param_leaf_shardings)
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  outs = {"canvas": rows, "commit": rows, "row_nfe": rows, "nfe": repl, "n_full": repl, "n_cached": repl,
          "n_window": repl}
  donate = (1, 3) if jax.default_backend() != "cpu" else ()
  return jax.jit(functools.partial(loop.run, **dict(static)), in_shardings=(p_sh, rows, rows, rows, repl, repl),
                 out_shardings=outs, donate_argnums=donate, compiler_options=loop.compiler_options() or None)


def collect(lay: Layout, out: dict, n_rows: int, eos_id: int) -> GenerationResult:
  canvas = sharding.to_host(out["canvas"])
  commit = sharding.to_host(out["commit"])
  row_nfe = sharding.to_host(out["row_nfe"])
  scalar = lambda k: int(sharding.to_host(out[k]))
  res = GenerationResult([], [], [], [], scalar("nfe"), [], [], {"full": scalar("n_full"), "cached": scalar("n_cached")})
  if lay.grid.windows:
    res.cached_windows = dict(zip(lay.grid.windows, sharding.to_host(out["n_window"]).tolist()))
  for r in range(n_rows):
    pad, P, end = int(lay.pad[r]), int(lay.prompt_len[r]), int(lay.end[r])
    row = canvas[r, pad:end].tolist()
    gen = row[P:]
    k = count_generated(gen, eos_id)
    res.canvas.append(row)
    res.tokens.append(gen[:k])
    res.num_tokens.append(k)
    res.commit_step.append(commit[r, pad + P:end].tolist())
    res.row_nfe.append(int(row_nfe[r]))
    res.prompt_lengths.append(P)
  return res


def generate(model, prompts, config: GenerationConfig | None = None, *, seed: int = 0,
             batch_bucket: int | None = None, on_block=None, programs=None) -> GenerationResult:
  """Generates for a batch of prompts (a list of token-id lists, ragged, or one list).

  Args:
    model: a dinfer_jax Model (from dinfer_jax.load) or a (params, ModelConfig) pair.
    config: GenerationConfig (default GenerationConfig()).
    seed: PRNG seed for temperature sampling; same seed, same output.
    batch_bucket: run the program at this many rows (the extra rows are invalid: they never decode and
      take part in no forward's NFE), so that batches of different sizes share one compiled program.
    on_block: streaming. Called from inside the running program (on a runtime thread) as each block is
      committed, with the block index and, per row, the generated tokens committed so far (before the first
      EOS); a row that stopped early repeats its tokens. The program is compiled once more for streaming.
    programs: an engine.programs.ProgramCache (one per model) holding the compiled programs, bounded and
      shareable between threads (the server's); default: jit's own cache.
  """
  params, mcfg = (model.params, model.config) if hasattr(model, "params") else model
  gcfg = config or GenerationConfig()
  prompts = normalize_prompts(prompts)
  lay, out, static = generate_arrays(params, mcfg, prompts, gcfg, seed=seed, batch_bucket=batch_bucket,
                                     on_block=on_block, mesh=getattr(model, "mesh", None), programs=programs)
  return collect(lay, out, len(prompts), static["eos_id"])
