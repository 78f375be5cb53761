"""The lm-evaluation-harness model `dinfer_jax`.

    lm_eval --model dinfer_jax --model_args pretrained=PATH,gen_length=256,block_length=32,cache=dual ...
    dinfer-jax lm-eval --model PATH --tasks gsm8k_llada_moe [--model-args k=v,...]   (any lm-eval version)

lm-eval finds the model through the `lm_eval.models` entry point (lm-eval releases with plugin discovery,
after 0.4.13) or through the `@register_model` below once this module is imported (`dinfer-jax lm-eval`
imports it; lm-eval 0.4.13 has no discovery).

- generate_until: requests are batched through dinfer_jax.generate (rows of different lengths in one
  engine call), `until` stop sequences cut the decoded answer, and `max_gen_toks` caps it: the canvas is
  gen_length positions (model_args / the model's generation_config.json), grown to max_gen_toks rounded up
  to whole blocks when that is longer, and the answer is cut to max_gen_toks tokens.
- loglikelihood: LLaDA's Monte-Carlo estimate (dinfer_jax.evaluation.loglik; mc_num, mc_batch_size);
  is_greedy: the continuation equals LLaDA's greedy low-confidence decode of it (one token per step).
- Decoding statistics (tokens, forwards, TPF, TPS, NFE per request) accumulate in `stats()` and are logged
  after every generate_until call; `dinfer-jax lm-eval` prints them beside the scores.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

import dinfer_jax
from dinfer_jax.answer import cut_at_stop, with_token_cap
from dinfer_jax.cli_common import model_generation_defaults
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.evaluation.loglik import mc_loglikelihood

log = logging.getLogger(__name__)

_NOT_KNOBS = ("device", "max_batch_size", "trust_remote_code", "parallelize")


def _coerce(field: dataclasses.Field, v):
  if v is None or v == "None":
    return None
  t = str(field.type)
  if t in ("bool", "<class 'bool'>"):
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")
  if field.name in ("mask_id", "eos_id") or t in ("int", "<class 'int'>"):
    return int(v)
  if t in ("float", "<class 'float'>"):
    return float(v)
  return str(v)


@register_model("dinfer_jax", "dinfer-jax")
class DinferJaxLM(LM):
  """model_args: pretrained (a directory, or "default" for the embedded model), dtype, batch_size (rows per
  engine call), mc_num / mc_batch_size (loglikelihood), seed, and any GenerationConfig knob."""

  def __init__(self, pretrained: str = "default", dtype: str = "float32", batch_size: int | str = 16,
               mc_num: int = 128, mc_batch_size: int = 32, seed: int = 0, **kwargs):
    super().__init__()
    self.model = dinfer_jax.load(pretrained, dtype=dtype)
    if self.model.tokenizer is None:
      raise ValueError(f"dinfer_jax: the model at {self.model.path} has no tokenizer; lm-eval sends text")
    fields = {f.name: f for f in dataclasses.fields(GenerationConfig)}
    knobs = model_generation_defaults(self.model.path)
    for k, v in kwargs.items():
      if k in _NOT_KNOBS:
        continue
      if k not in fields:
        raise ValueError(f"dinfer_jax: unknown model_args key {k!r}; GenerationConfig knobs are "
                         f"{', '.join(fields)}")
      knobs[k] = _coerce(fields[k], v)
    self.gcfg = GenerationConfig(**knobs)
    self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
    if self.batch_size <= 0:
      raise ValueError(f"dinfer_jax: batch_size={batch_size} must be positive")
    self.mc_num, self.mc_batch_size, self.seed = int(mc_num), int(mc_batch_size), int(seed)
    if self.mc_num <= 0 or self.mc_batch_size <= 0 or self.mc_num % self.mc_batch_size:
      raise ValueError(f"dinfer_jax: mc_num={mc_num} must be a positive multiple of mc_batch_size={mc_batch_size}")
    self._stats = {"requests": 0, "tokens": 0, "row_forwards": 0, "engine_forwards": 0, "engine_calls": 0,
                   "seconds": 0.0}
    self._warned_truncation = False

  # ------------------------------------------------------------------ lm-eval plumbing

  @property
  def tokenizer_name(self) -> str:
    return str(self.model.path)

  def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    return self.model.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)

  def stats(self) -> dict[str, Any]:
    """Decoding statistics of every generate_until call so far: TPF = tokens / row forwards, TPS = tokens
    / engine seconds (compiles included), NFE per request."""
    s = dict(self._stats)
    s["tpf"] = s["tokens"] / s["row_forwards"] if s["row_forwards"] else 0.0
    s["tps"] = s["tokens"] / s["seconds"] if s["seconds"] else 0.0
    s["nfe_per_request"] = s["row_forwards"] / s["requests"] if s["requests"] else 0.0
    return s

  def _encode(self, text: str) -> list[int]:
    return self.model.tokenizer.encode(text, add_special_tokens=False)

  def _decode(self, ids) -> str:
    return self.model.tokenizer.decode(list(ids), skip_special_tokens=True)

  # ------------------------------------------------------------------ generation

  def config_for(self, max_gen_toks: int | None, temperature: float) -> GenerationConfig:
    g = with_token_cap(self.gcfg, int(max_gen_toks) if max_gen_toks else None)
    if temperature != g.temperature:
      g = g.replace(temperature=float(temperature))
    return g

  def _fit(self, ids: list[int], g: GenerationConfig) -> list[int]:
    room = self.model.config.max_position - g.gen_length
    if len(ids) > room:
      if room <= 0:
        raise ValueError(f"dinfer_jax: gen_length={g.gen_length} leaves no room for a prompt in "
                         f"max_position={self.model.config.max_position}")
      if not self._warned_truncation:
        log.warning("dinfer_jax: contexts longer than %d tokens are cut from the left", room)
        self._warned_truncation = True
      ids = ids[-room:]
    return ids

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    out: list[str | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    parsed = []
    for i, req in enumerate(requests):
      context, kw = req.args[0], dict(req.args[1] or {})
      until = kw.pop("until", None)
      until = [until] if isinstance(until, str) else list(until or [])
      cap = kw.pop("max_gen_toks", None) or kw.pop("max_new_tokens", None) or kw.pop("max_tokens", None)
      do_sample = bool(kw.pop("do_sample", False))
      temp = float(kw.pop("temperature", 0.0) or 0.0) if do_sample else 0.0  # lm-eval: no do_sample, greedy
      parsed.append((context, until, cap))
      groups.setdefault((int(cap) if cap else None, temp), []).append(i)
    for (cap, temp), idx in groups.items():
      g = self.config_for(cap, temp)
      for start in range(0, len(idx), self.batch_size):
        chunk = idx[start:start + self.batch_size]
        prompts = [self._fit(self._encode(parsed[i][0]), g) for i in chunk]
        t = time.perf_counter()
        res = dinfer_jax.generate(self.model, prompts, g, seed=self.seed, batch_bucket=self.batch_size)
        self._stats["seconds"] += time.perf_counter() - t
        self._stats["engine_calls"] += 1
        self._stats["engine_forwards"] += res.nfe
        for r, i in enumerate(chunk):
          toks = res.tokens[r][:cap] if cap else res.tokens[r]
          text, _ = cut_at_stop(self._decode(toks), parsed[i][1])
          out[i] = text
          self._stats["requests"] += 1
          self._stats["tokens"] += len(toks)
          self._stats["row_forwards"] += res.row_nfe[r]
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
    log.info("dinfer_jax decoding: %s", self.stats())
    return out

  # ------------------------------------------------------------------ likelihood

  def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    # Trailing spaces of the context belong to the continuation (lm-eval's convention for BPE tokenizers).
    n = len(context) - len(context.rstrip())
    if n:
      context, continuation = context[:-n], context[-n:] + continuation
    whole = self._encode(context + continuation)
    ctx = self._encode(context)
    return ctx, whole[len(ctx):]

  def greedy_matches(self, context: list[int], target: list[int]) -> bool:
    """Whether LLaDA's greedy low-confidence decode of len(target) positions after context gives target."""
    L = len(target)
    g = self.gcfg.replace(gen_length=L, block_length=L, decoder="fixed_steps", steps_per_block=L, cache="none",
                          prefix_look=0, after_look=0, warmup_steps=0, cont_weight=0.0, temperature=0.0,
                          early_stop=False, start_block_align=False)
    res = dinfer_jax.generate(self.model, [context], g)
    return res.canvas[0][len(context):len(context) + L] == list(target)

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    out = []
    for req in requests:
      ctx, cont = self._encode_pair(*req.args)
      ll, _ = mc_loglikelihood(self.model, ctx, cont, mc_num=self.mc_num, batch_size=self.mc_batch_size,
                               seed=self.seed, mask_id=self.gcfg.mask_id)
      greedy = self.greedy_matches(ctx, cont)
      out.append((ll, greedy))
      self.cache_hook.add_partial("loglikelihood", req.args, (ll, greedy))
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    raise NotImplementedError("dinfer_jax: a diffusion LM has no left-to-right rolling likelihood; "
                              "use loglikelihood (LLaDA's Monte-Carlo estimate) or generation tasks")
