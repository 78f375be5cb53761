"""Host side of generation: prompts -> canvas layout -> one jitted program -> per-row results."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import sharding
from dinfer_jax.config import ModelConfig
from dinfer_jax.engine import cache_policy, loop
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.layout import Layout, make_layout, normalize_prompts, round_up
from dinfer_jax.engine.program import DenoiseProgram, Knobs
from dinfer_jax.engine.state import Counters, RunOutput
from dinfer_jax.model import moe
from dinfer_jax.model import params as params_lib
from dinfer_jax.sharding import use_mesh


@dataclasses.dataclass
class GenerationResult:
  """Per-row results of one generate call.

  tokens: generated tokens before the first EOS, at most gen_length (what a user reads, and what TPS counts).
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


def count_generated(generated: Sequence[int], stops: int | Sequence[int]) -> int:
  """The token counter for TPS/TPF (docs/design.md, D10): generated tokens before the first EOS (stops: the
  EOS id, or every id that ends an answer)."""
  stops = {stops} if isinstance(stops, (int, np.integer)) else set(stops)
  for i, t in enumerate(generated):
    if t in stops:
      return i
  return len(generated)


def bucket_rows(n: int) -> int:
  """Rows of the compiled program for n prompts: powers of two up to 16, then multiples of 16, so a new
  batch size reuses a compiled program (the extra rows stay invalid: they never decode and cost no NFE)."""
  if n <= 16:
    return 1 << (n - 1).bit_length()
  return -(-n // 16) * 16


def prepare(mcfg: ModelConfig, prompts, gcfg: GenerationConfig, *, batch_bucket: int | None = None,
            row_multiple: int = 1, stream: bool = False) -> tuple[Layout, DenoiseProgram]:
  """Validates and lays out the prompts; returns the layout and the program that runs it.
  batch_bucket: run at this many rows (default bucket_rows(len(prompts))); the extra rows are invalid.
  row_multiple: the canvas gets a multiple of this many rows (the data-parallel width: every device takes
  an equal share; the added rows are invalid and never decode). stream: the program hands each finished
  block to the host (engine.loop.register_stream)."""
  policy = cache_policy.for_config(mcfg, gcfg)
  prompts = normalize_prompts(prompts)
  if batch_bucket is not None and batch_bucket < len(prompts):
    raise ValueError(f"generate: batch_bucket={batch_bucket} is smaller than the {len(prompts)} prompts")
  rows = round_up(batch_bucket or bucket_rows(len(prompts)), row_multiple)
  lay = make_layout(prompts, gcfg, mcfg, policy, batch_bucket=rows)
  return lay, DenoiseProgram.build(mcfg, gcfg, lay.grid, policy).replace(stream=stream)


def engine_params(params: dict, mcfg: ModelConfig | None = None) -> dict:
  """The per-layer layout the programs run on. A loaded Model's params already have it (params.engine_layout,
  made once at load); stacked params (a (params, config) pair from training) are unstacked for this call."""
  return params if params_lib.is_unstacked(params) else params_lib.unstack_layers(params)


def _model_parts(model) -> tuple[dict, ModelConfig, jax.sharding.Mesh | None]:
  if hasattr(model, "params"):
    return model.params, model.config, model.mesh
  params, mcfg = model
  return params, mcfg, None


def _device_args(lay: Layout, seed: int, knobs: Knobs, mesh: jax.sharding.Mesh | None) -> tuple:
  """(canvas, valid, positions, key, knobs) on the device: with a mesh, rows split on "data", the rest
  replicated."""
  if mesh is None:
    return (jnp.asarray(lay.canvas), jnp.asarray(lay.valid), jnp.asarray(lay.positions), jax.random.PRNGKey(seed),
            knobs)
  rows = sharding.row_sharded(mesh, lay.canvas.shape)
  repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  put = lambda a: sharding.put_global(np.asarray(a), repl)  # noqa: E731
  return (*(sharding.put_global(a, rows) for a in (lay.canvas, lay.valid, lay.positions)),
          put(jax.random.PRNGKey(seed)), jax.tree_util.tree_map(put, knobs))


def generate_arrays(params: dict, mcfg: ModelConfig, prompts, gcfg: GenerationConfig, *, seed: int = 0,
                    batch_bucket: int | None = None, on_block=None, mesh: jax.sharding.Mesh | None = None,
                    programs=None) -> tuple[Layout, RunOutput, DenoiseProgram]:
  """Runs the program; returns (layout, device outputs, program) without host post-processing (for
  benchmarks). on_block(block_index, rows_tokens): see generate. With a mesh the program runs with explicit
  in/out shardings (see sharded_run). programs: an engine.programs.ProgramCache to take the program from (and
  keep it in) instead of jit's own unbounded cache; not with a mesh."""
  stream = on_block is not None
  lay, prog = prepare(mcfg, prompts, gcfg, batch_bucket=batch_bucket, row_multiple=sharding.data_size(mesh),
                      stream=stream)
  params = engine_params(params, mcfg)
  args = _device_args(lay, seed, Knobs.of(gcfg), mesh)
  if mesh is not None:
    if programs is not None:
      raise ValueError("generate: a ProgramCache is not supported together with a mesh yet")
    if stream:
      raise ValueError("generate: streaming (on_block) is not supported together with a mesh yet")
    leaves, treedef = jax.tree_util.tree_flatten(
        sharding.param_shardings(params, params_lib.unstacked_logical_axes(mcfg, params), mesh))
    with use_mesh(mesh), moe.partitioned(mesh.size > 1):
      return lay, sharded_run(mesh, treedef, tuple(leaves), prog)(params, *args), prog
  run = (functools.partial(loop.run_jit(), prog) if programs is None
         else programs.get(program_key(prog), lambda: _compile(prog, params, args)))
  if not stream:
    return lay, run(params, *args), prog
  sid = loop.register_stream(_row_tokens_callback(lay, len(normalize_prompts(prompts)), prog.stop_ids, on_block))
  try:
    out = jax.block_until_ready(run(params, *args, jnp.int32(sid)))
  finally:
    loop.unregister_stream(sid)
  return lay, out, prog


def program_key(prog: DenoiseProgram) -> tuple:
  """A compiled program's identity in a ProgramCache (one cache per model: the params' shapes are fixed):
  the program itself (its grid holds the canvas shape, its stream flag whether it streams)."""
  return ("generate", prog)


def _compile(prog: DenoiseProgram, params, args: tuple):
  """loop.run compiled ahead of time for these arguments' shapes (the values are not read)."""
  extra = (jnp.int32(0),) if prog.stream else ()
  return loop.run_jit().lower(prog, params, *args, *extra).compile()


def _abstract_args(lay: Layout, gcfg: GenerationConfig) -> tuple:
  abstract = lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype)  # noqa: E731
  return (*(abstract(a) for a in (lay.canvas, lay.valid, lay.positions)), abstract(jax.random.PRNGKey(0)),
          jax.tree_util.tree_map(abstract, Knobs.of(gcfg)))


def program_ready(programs, model, prompts, gcfg: GenerationConfig, *, batch_bucket: int | None = None,
                  stream: bool = False) -> bool:
  """Whether `programs` holds the program generate(model, prompts, gcfg, ...) would run (nothing compiles)."""
  _, mcfg, _ = _model_parts(model)
  lay, prog = prepare(mcfg, prompts, gcfg, batch_bucket=batch_bucket, stream=stream)
  return programs.ready(program_key(prog))


def compile_program(programs, model, prompts, gcfg: GenerationConfig, *, batch_bucket: int | None = None,
                    stream: bool = False) -> bool:
  """Puts into `programs` the program generate(model, prompts, gcfg, ...) would run, compiled without running
  it. Returns whether it had to be built."""
  params, mcfg, _ = _model_parts(model)
  lay, prog = prepare(mcfg, prompts, gcfg, batch_bucket=batch_bucket, stream=stream)
  key = program_key(prog)
  if programs.ready(key):
    return False
  programs.get(key, lambda: _compile(prog, engine_params(params, mcfg), _abstract_args(lay, gcfg)))
  return True


def committed_tokens(canvas_row: np.ndarray, start: int, end: int, upto: int, eos_id: int | Sequence[int]) -> list[int]:
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
    on_block(k, [committed_tokens(canvas[r], int(lay.pad[r] + lay.prompt_len[r]), int(lay.answer_end[r]), upto, eos_id)
                 for r in range(n_rows)])
  return emit


@functools.cache
def sharded_run(mesh: jax.sharding.Mesh, param_treedef, param_leaf_shardings: tuple, prog: DenoiseProgram):
  """The generation program with explicit shardings: params as the logical-axis rules place them; canvas,
  valid, positions and the per-row outputs split by batch rows on "data"; counters and knobs replicated. On
  accelerators the canvas and positions buffers are donated (they alias the canvas and commit outputs). One
  compiled program per mesh, param layout and program."""
  p_sh = jax.tree_util.tree_unflatten(param_treedef, param_leaf_shardings)
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  outs = RunOutput(canvas=rows, commit=rows, row_nfe=rows, counters=Counters(repl, repl, repl, repl))
  donate = (1, 3) if jax.default_backend() != "cpu" else ()
  return jax.jit(functools.partial(loop.run, prog), in_shardings=(p_sh, rows, rows, rows, repl, repl),
                 out_shardings=outs, donate_argnums=donate, compiler_options=loop.compiler_options() or None)


def collect(lay: Layout, out: RunOutput, n_rows: int, eos_id: int | Sequence[int]) -> GenerationResult:
  """Per-row results on the host; eos_id: the EOS id, or every id that ends an answer (DenoiseProgram.stop_ids)."""
  canvas = sharding.to_host(out.canvas)
  commit = sharding.to_host(out.commit)
  row_nfe = sharding.to_host(out.row_nfe)
  c = out.counters
  scalar = lambda x: int(sharding.to_host(x))  # noqa: E731
  res = GenerationResult([], [], [], [], scalar(c.nfe), [], [], {"full": scalar(c.n_full), "cached": scalar(c.n_cached)})
  if lay.grid.windows:
    res.cached_windows = dict(zip(lay.grid.windows, sharding.to_host(c.n_window).tolist()))
  for r in range(n_rows):
    pad, P, end = int(lay.pad[r]), int(lay.prompt_len[r]), int(lay.end[r])
    row = canvas[r, pad:end].tolist()
    gen = row[P:int(lay.answer_end[r]) - pad]
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
    model: a dinfer_jax Model (from dinfer_jax.load: its params are in the engine's layout and on its mesh) or
      a (params, ModelConfig) pair (stacked params are unstacked for each call).
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
  params, mcfg, mesh = _model_parts(model)
  gcfg = config or GenerationConfig()
  prompts = normalize_prompts(prompts)
  lay, out, prog = generate_arrays(params, mcfg, prompts, gcfg, seed=seed, batch_bucket=batch_bucket,
                                   on_block=on_block, mesh=mesh, programs=programs)
  return collect(lay, out, len(prompts), prog.stop_ids)
