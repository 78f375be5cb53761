"""Training objectives. Every loss has the signature the trainer takes:

  loss_fn(params, batch, rng) -> (loss scalar, metrics dict of scalars)

`batch` is a dict of arrays (see `train_td.data.Batch`): tokens [B, T] int32 (left-padded prompt, then a
fixed answer region of A tokens: answer, <|eos|>, then <|eos|> padding), valid [B, T] bool (False on the
left padding: excluded from attention as keys), positions [B, T] int32 (RoPE positions counted from each
row's first prompt token, as the inference engine lays rows out), and answer [B, T] bool (the answer region:
the only positions that may be masked). A trajectory-distillation loss (compressed multi-step transitions)
plugs into the same trainer by taking the same arguments and adding its own fields to the batch.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dinfer_jax.config import ModelConfig
from dinfer_jax.model.transformer import forward

LossFn = Callable[[Any, dict, jax.Array], tuple[jax.Array, dict]]


def masked_diffusion_loss_from_masked(logits: jax.Array, targets: jax.Array, masked: jax.Array, t: jax.Array,
                                      answer_len: jax.Array) -> jax.Array:
  """Per-row LLaDA SFT loss given which positions were masked.

  Args:
    logits: [B, T, V] fp32 model outputs on the noised input.
    targets: [B, T] clean token ids.
    masked: [B, T] bool, positions replaced by <|mask|> (only answer positions).
    t: [B] masking ratio of each row (the loss is weighted by 1/t).
    answer_len: [B] answer-region length the row's loss is normalised by.

  Returns:
    [B] per-row loss: sum over masked positions of CE / t, divided by answer_len.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  ce = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  ce = jnp.where(masked, ce, 0.0)
  return ce.sum(-1) / t / answer_len.astype(jnp.float32)


def sample_mask(rng: jax.Array, answer: jax.Array, eps: float = 1e-3) -> tuple[jax.Array, jax.Array]:
  """t ~ U(eps, 1] per row, then each answer position masked independently with probability t."""
  k_t, k_m = jax.random.split(rng)
  B = answer.shape[0]
  t = eps + (1.0 - eps) * (1.0 - jax.random.uniform(k_t, (B,)))  # (eps, 1]
  masked = (jax.random.uniform(k_m, answer.shape) < t[:, None]) & answer
  return t, masked


def masked_diffusion_loss(params, batch: dict, rng: jax.Array, *, cfg: ModelConfig, mask_id: int,
                          eps: float = 1e-3, moe_impl: str | None = "dense") -> tuple[jax.Array, dict]:
  """LLaDA's masked-diffusion SFT loss on a batch (prompt never masked, answer + EOS padding masked with
  probability t, CE on masked positions weighted 1/t, normalised by the answer length, batch mean)."""
  tokens, answer = batch["tokens"], batch["answer"]
  t, masked = sample_mask(rng, answer, eps)
  noised = jnp.where(masked, mask_id, tokens)
  logits = forward(params, cfg, noised, positions=batch["positions"], mask=batch["valid"],
                   moe_impl=moe_impl).logits
  answer_len = answer.sum(-1)
  per_row = masked_diffusion_loss_from_masked(logits, tokens, masked, t, answer_len)
  loss = per_row.mean()
  n_masked = masked.sum()
  logp = jax.nn.log_softmax(logits, axis=-1)
  ce = -jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
  correct = (jnp.argmax(logits, -1) == tokens) & masked
  metrics = {
      "loss": loss,
      "masked_ce": jnp.where(masked, ce, 0.0).sum() / jnp.maximum(n_masked, 1),
      "masked_acc": correct.sum() / jnp.maximum(n_masked, 1),
      "masked_tokens": n_masked.astype(jnp.float32),
  }
  return loss, metrics


def make_loss_fn(cfg: ModelConfig, *, mask_id: int | None = None, eps: float = 1e-3,
                 moe_impl: str | None = "dense") -> LossFn:
  """The masked-diffusion loss bound to a model config: loss_fn(params, batch, rng)."""
  return functools.partial(masked_diffusion_loss, cfg=cfg,
                           mask_id=cfg.mask_token_id if mask_id is None else mask_id, eps=eps,
                           moe_impl=moe_impl)
