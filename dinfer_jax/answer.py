"""What a user gets back, shared by the CLI, the server and the lm-eval model: a token cap (max_tokens /
--max-new-tokens / max_gen_toks), stop sequences, and the settled part of a streamed partial answer."""
from __future__ import annotations

from typing import Sequence

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


def settled_prefix(text: str, stops: Sequence[str] | None) -> str:
  """The part of a partial answer (the text of the tokens committed so far) that later tokens cannot
  change: before the earliest stop sequence found, before any tail that may be the start of a stop
  sequence, and before a trailing replacement character (a multi-byte character cut in two)."""
  cut, found = cut_at_stop(text, stops)
  end = len(cut) if found else len(text)
  for s in stops or ():
    for k in range(min(len(s) - 1, len(text)), 0, -1):
      if text.endswith(s[:k]):
        end = min(end, len(text) - k)
        break
  while end > 0 and text[end - 1] == "\ufffd":
    end -= 1
  return text[:end]


def shown_answer(text: str) -> str:
  """An answer as the CLI prints it and chat returns it. Surrounding whitespace (the default model's column
  padding, " 627") only blurs where an answer starts. A prefix's shown form is a prefix of the whole answer's,
  so streamed pieces of it add up to the final text."""
  return text.strip()
