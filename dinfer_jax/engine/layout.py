"""Canvas layout: how ragged prompts become one padded [B, Tc] canvas with a shared block grid.

Each row is left-padded so that its first block starts at the same canvas index C for every row:
    row r:  [ pad (invalid) | prompt_r | MASK * G | tail pad (invalid) ]
            0            pad_r      pad_r + P_r   end_r                Tc
The first block of row r starts at s0_r = P_r (or floor(P_r / B) * B with start_block_align, or for block
diffusion), so pad_r = C - s0_r and blocks are [C + iB, C + (i+1)B) for all rows at once. Invalid
positions are masked out of attention and never decoded, and each row's RoPE positions count from its
own first token, so a row's result equals running it alone. C is rounded up to a bucket and the block
count is fixed per (bucket, gen_length), so prompts of the same bucket reuse one compiled program.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from dinfer_jax.config import ModelConfig
from dinfer_jax.engine.config import GenerationConfig


@dataclasses.dataclass(frozen=True)
class Grid:
  """The static shape of one compiled generation program."""
  batch: int
  canvas_len: int  # Tc
  first_block: int  # C
  num_blocks: int
  block_len: int
  window: int  # width of the cached forward's input (0 without a cache; the widest of `windows`)
  prefill_len: int  # block diffusion's prefill width (0 otherwise)
  # Prefix cache: the bucketed widths its cached forward shrinks through (cache_policy.PrefixCache).
  windows: tuple[int, ...] = ()


@dataclasses.dataclass
class Layout:
  grid: Grid
  canvas: np.ndarray  # [B, Tc] int32
  valid: np.ndarray  # [B, Tc] bool
  positions: np.ndarray  # [B, Tc] int32
  pad: np.ndarray  # [B] canvas index of each row's first prompt token
  prompt_len: np.ndarray  # [B]
  end: np.ndarray  # [B] canvas index one past each row's last generated position
  # [B] one past the last position a user reads: pad + P + gen_length (block diffusion decodes its last block
  # whole, past gen_length; those positions stay on the canvas but are not part of the answer).
  answer_end: np.ndarray | None = None

  def __post_init__(self):
    if self.answer_end is None:
      self.answer_end = self.end


def normalize_prompts(prompts) -> list[list[int]]:
  """One list of ids or a list of lists -> list of lists, checked."""
  if isinstance(prompts, np.ndarray):
    prompts = prompts.tolist()
  if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
    raise ValueError("generate: prompts must be a non-empty list of token ids or a list of such lists")
  if all(isinstance(t, (int, np.integer)) for t in prompts):
    prompts = [prompts]
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, np.ndarray):
      p = p.tolist()
    if not isinstance(p, (list, tuple)) or not all(isinstance(t, (int, np.integer)) for t in p):
      raise ValueError(f"generate: prompt {i} is not a list of int token ids")
    if len(p) == 0:
      raise ValueError(f"generate: prompt {i} is empty")
    out.append([int(t) for t in p])
  return out


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def make_layout(prompts: Sequence[Sequence[int]], gcfg: GenerationConfig, mcfg: ModelConfig, policy: Any, *,
                batch_bucket: int | None = None) -> Layout:
  """The canvas of `prompts` for the cache policy (engine.cache_policy: block diffusion's layout, the cached
  forward's window widths)."""
  B, G = gcfg.block_length, gcfg.gen_length
  block_diffusion = policy.block_diffusion
  mask_id, eos_id = gcfg.token_ids(mcfg)
  n = len(prompts)
  rows = batch_bucket or n
  lens = np.array([len(p) for p in prompts])
  for i, p in enumerate(prompts):
    bad = [t for t in p if not 0 <= t < mcfg.vocab_size]
    if bad:
      raise ValueError(f"generate: prompt {i} has token id {bad[0]} outside the vocabulary [0, {mcfg.vocab_size})")
    if mask_id in p:
      raise ValueError(f"generate: prompt {i} contains the mask token id {mask_id}")
  aligned = gcfg.start_block_align or block_diffusion
  s0 = (lens // B) * B if aligned else lens
  if block_diffusion:
    ends_rel = np.array([round_up(int(P) + G, B) for P in lens])  # BD pads the canvas to whole blocks
  else:
    ends_rel = lens + G
  too_long = np.nonzero(ends_rel > mcfg.max_position)[0]
  if too_long.size:
    i = int(too_long[0])
    raise ValueError(f"generate: prompt {i} has {lens[i]} tokens; with gen_length={G} that needs "
                     f"{ends_rel[i]} positions, more than the model's max_position={mcfg.max_position}")
  # Block diffusion's block-causal mask is defined on position blocks: keep pads whole blocks.
  step = math.lcm(gcfg.prompt_bucket, B) if block_diffusion else gcfg.prompt_bucket
  # Block diffusion buckets by prompt length as the others do (C from P, not from the aligned s0 <= P), so that
  # prompts of one bucket share a canvas geometry (one program, one continuous-batching pool).
  C = round_up(int(lens.max() if block_diffusion else s0.max()), step)
  nb = math.ceil((B - 1 + G) / B) if aligned else math.ceil(G / B)
  window = policy.window_width(B, nb)
  Tc = max(C + nb * B, window)
  canvas = np.full((rows, Tc), eos_id, np.int32)
  valid = np.zeros((rows, Tc), bool)
  pos = np.zeros((rows, Tc), np.int32)
  pad = np.zeros(rows, np.int64)
  end = np.zeros(rows, np.int64)
  for r in range(n):
    pr = C - int(s0[r])
    pad[r], end[r] = pr, pr + int(ends_rel[r])
    canvas[r, pr:pr + lens[r]] = prompts[r]
    canvas[r, pr + lens[r]:end[r]] = mask_id
    valid[r, pr:end[r]] = True
    pos[r] = np.maximum(np.arange(Tc) - pr, 0)
  # Rows added only to fill a batch bucket stay invalid everywhere: they never decode and cost no NFE.
  prefill = max(C, B) if block_diffusion else 0
  windows = policy.window_widths(B, nb)
  grid = Grid(batch=rows, canvas_len=Tc, first_block=C, num_blocks=nb, block_len=B, window=window,
              prefill_len=prefill, windows=windows)
  answer_end = np.where(end > 0, np.minimum(end, pad + np.concatenate([lens, np.zeros(rows - n, int)]) + G), 0)
  return Layout(grid, canvas, valid, pos, pad, np.concatenate([lens, np.zeros(rows - n, int)]), end, answer_end)
