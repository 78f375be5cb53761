"""What a user gets back, shared by the CLI, the server and the lm-eval model: a token cap (max_tokens /
--max-new-tokens / max_gen_toks), stop sequences, and the per-block pieces of a streamed answer."""
from __future__ import annotations

import os
from typing import Callable, Sequence

from dinfer_jax.engine.config import GenerationConfig


def with_token_cap(gcfg: GenerationConfig, cap: int | None) -> GenerationConfig:
  """The config for an answer of at most `cap` tokens. A diffusion model fills its whole canvas at once,
  so a cap below gen_length keeps the canvas (the answer is cut afterwards, as an autoregressive model's
  answer is a prefix of its longer answer) and a cap above it grows the canvas to whole blocks."""
  if cap is None:
    return gcfg
  if cap <= 0:
    raise ValueError(f"max new tokens must be positive, got {cap}")
  if cap > gcfg.gen_length:
    return gcfg.replace(gen_length=-(-cap // gcfg.block_length) * gcfg.block_length)
  return gcfg


def cut_at_stop(text: str, stops: Sequence[str] | None) -> tuple[str, bool]:
  """Cuts `text` before the earliest occurrence of any stop sequence; (text, whether one was found)."""
  best = -1
  for s in stops or ():
    i = text.find(s) if s else -1
    if i >= 0 and (best < 0 or i < best):
      best = i
  return (text[:best], True) if best >= 0 else (text, False)


def block_ends(prompt_len: int, block_length: int, n_tokens: int, *, aligned: bool) -> list[int]:
  """Where each decoded block ends, in generated-token coordinates (clipped to n_tokens). The first block
  starts at the prompt's end, or at floor(P / B) * B when blocks are aligned to positions."""
  s0 = (prompt_len // block_length) * block_length if aligned else prompt_len
  ends, e = [], s0 + block_length - prompt_len
  while e < n_tokens:
    ends.append(e)
    e += block_length
  return ends + [n_tokens]


def stream_pieces(decode: Callable[[Sequence[int]], str], tokens: Sequence[int], ends: Sequence[int],
                  text: str) -> list[str]:
  """Splits the final answer `text` into the pieces that became known as each block was committed: the
  text decoded from the tokens up to each block end, kept to where it agrees with `text` (a stop sequence
  may have cut it). The pieces concatenate to `text` exactly."""
  pieces, sent = [], 0
  for e in ends:
    known = len(os.path.commonprefix([decode(tokens[:e]), text]))
    if known > sent:
      pieces.append(text[sent:known])
      sent = known
  if sent < len(text):
    pieces.append(text[sent:])
  return pieces
