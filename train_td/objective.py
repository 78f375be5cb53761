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
COMPUTE_DTYPES = ("float32", "bfloat16")


def mixed_precision(loss_fn: LossFn, compute_dtype: str | None) -> LossFn:
  """The loss computed in `compute_dtype` on master weights of their own dtype (fp32 in training).

  The weights are cast inside the differentiated function, so the forward's matmuls and activations run in
  bf16 while the gradients arrive in the master dtype (the cast's transpose) and the optimizer updates fp32
  weights: small updates are not rounded away. Norm statistics, router, logits and losses stay fp32 (the
  model casts them), as the dtype policy asks.
  """
  if compute_dtype in (None, "float32"):
    return loss_fn
  if compute_dtype not in COMPUTE_DTYPES:
    raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
  dt = jnp.dtype(compute_dtype)

  def low_precision_loss(params, batch, rng):
    cast = lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
    return loss_fn(jax.tree_util.tree_map(cast, params), batch, rng)

  return low_precision_loss


def masked_diffusion_loss_from_masked(logits: jax.Array, targets: jax.Array, masked: jax.Array, t: jax.Array,
                                      answer_len: jax.Array, forced: jax.Array | None = None) -> jax.Array:
  """Per-row LLaDA SFT loss given which positions were masked.

  Args:
    logits: [B, T, V] fp32 model outputs on the noised input.
    targets: [B, T] clean token ids.
    masked: [B, T] bool, positions replaced by <|mask|> (only answer positions).
    t: [B] masking ratio of each row (the loss is weighted by 1/t).
    answer_len: [B] answer-region length the row's loss is normalised by.
    forced: [B, T] bool or None, positions masked by a block cut (sample_block_cut) rather than with
      probability t: weighted 1, not 1/t (a row with small t and a cut near the start would otherwise
      weigh its many forced positions by up to 1/eps).

  Returns:
    [B] per-row loss: sum over masked positions of CE / t (CE on forced ones), divided by answer_len.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  ce = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  weight = jnp.broadcast_to(1.0 / t[:, None], ce.shape)
  if forced is not None:
    weight = jnp.where(forced, 1.0, weight)
  ce = jnp.where(masked, ce * weight, 0.0)
  return ce.sum(-1) / answer_len.astype(jnp.float32)


def sample_mask(rng: jax.Array, answer: jax.Array, eps: float = 1e-3) -> tuple[jax.Array, jax.Array]:
  """t ~ U(eps, 1] per row, then each answer position masked independently with probability t."""
  k_t, k_m = jax.random.split(rng)
  B = answer.shape[0]
  t = eps + (1.0 - eps) * (1.0 - jax.random.uniform(k_t, (B,)))  # (eps, 1]
  masked = (jax.random.uniform(k_m, answer.shape) < t[:, None]) & answer
  return t, masked


BLOCK_CUT_SPANS = ("canvas", "task")


def sample_block_cut(rng: jax.Array, answer: jax.Array, prob: float,
                     span: jax.Array | None = None) -> jax.Array:
  """[B, T] bool: with probability `prob` per row, every answer position from a cut drawn uniformly over
  the first `span` [B] positions of the row's answer region (default: all of it) onwards (else nothing).

  Block-wise decoding shows the model a canvas whose later blocks are still all masked while the current
  one fills; independent masking at ratio t almost never does on a long canvas (56 masked positions
  after an 8-token answer need t close to 1), so a model trained only that way changes its answer when the
  canvas grows. A cut drawn over a 64-token canvas still lands in the first 8 positions, where an 8-token
  answer is decoded, only one time in 8; `span` = the task's own region puts every cut there.
  """
  k_on, k_cut = jax.random.split(rng)
  B = answer.shape[0]
  region = jnp.cumsum(answer, axis=-1) - 1  # index within the answer region; -1 before it
  n = answer.sum(-1)
  if span is not None:
    n = jnp.minimum(n, span.astype(n.dtype))
  cut = jnp.floor(jax.random.uniform(k_cut, (B,)) * n).astype(jnp.int32)
  on = jax.random.uniform(k_on, (B,)) < prob
  return answer & on[:, None] & (region >= cut[:, None])


def masked_diffusion_loss(params, batch: dict, rng: jax.Array, *, cfg: ModelConfig, mask_id: int,
                          eps: float = 1e-3, moe_impl: str | None = "dense", remat: bool = False,
                          block_prob: float = 0.0, block_cut_span: str = "canvas") -> tuple[jax.Array, dict]:
  """LLaDA's masked-diffusion SFT loss on a batch (prompt never masked, answer + EOS padding masked with
  probability t, CE on masked positions weighted 1/t, normalised by the answer length, batch mean).

  block_prob: the share of rows that also mask everything after a random cut (sample_block_cut). The
  batch may carry norm_len [B] (train_td.data with canvases): the length a row's loss is normalised by
  in place of its answer region's. block_cut_span: where the cut is drawn, "canvas" (the whole answer
  region) or "task" (its first norm_len positions, the task's own region; see sample_block_cut).
  """
  tokens, answer = batch["tokens"], batch["answer"]
  t, masked = sample_mask(rng, answer, eps)
  forced = None
  if block_prob:
    span = batch.get("norm_len") if block_cut_span == "task" else None
    forced = sample_block_cut(jax.random.fold_in(rng, 1), answer, block_prob, span)
    masked = masked | forced
  noised = jnp.where(masked, mask_id, tokens)
  logits = forward(params, cfg, noised, positions=batch["positions"], mask=batch["valid"],
                   moe_impl=moe_impl, remat=remat).logits
  answer_len = batch["norm_len"] if "norm_len" in batch else answer.sum(-1)
  per_row = masked_diffusion_loss_from_masked(logits, tokens, masked, t, answer_len, forced)
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
                 moe_impl: str | None = "dense", remat: bool = False, compute_dtype: str | None = None,
                 block_prob: float = 0.0, block_cut_span: str = "canvas") -> LossFn:
  """The masked-diffusion loss bound to a model config: loss_fn(params, batch, rng). remat: gradient
  checkpointing per layer; compute_dtype: see mixed_precision; block_prob, block_cut_span: see
  masked_diffusion_loss."""
  if block_cut_span not in BLOCK_CUT_SPANS:  # else a misspelt span would silently train as "canvas"
    raise ValueError(f"block_cut_span must be one of {BLOCK_CUT_SPANS}, got {block_cut_span!r}")
  return mixed_precision(functools.partial(masked_diffusion_loss, cfg=cfg,
                                           mask_id=cfg.mask_token_id if mask_id is None else mask_id, eps=eps,
                                           moe_impl=moe_impl, remat=remat, block_prob=block_prob,
                                           block_cut_span=block_cut_span), compute_dtype)


# ------------------------------------------------------------------------------ trajectory distillation
# A golden trajectory (train_td.td_data) is stored as the final canvas plus, per generated position, its
# reveal step r: the number of forwards after which the position holds its final token (the engine's
# commit step; positions filled by early stop are revealed after the row's last forward, n_steps). The
# state after k forwards is therefore s_k = tokens where r <= k, <|mask|> elsewhere (prompt: r = 0).


def sample_transition(rng: jax.Array, n_steps: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per row a pair of states a < b on its trajectory: a ~ U{0..N-1}, then b ~ U{a+1..N} (N = n_steps).

  In dInfer's notation (s_N noisiest) this is i > j: the input is the noisier state s_a, the targets the
  tokens revealed between s_a and s_b, so the model learns to make b - a forwards' worth of commits in one.
  """
  k_a, k_b = jax.random.split(rng)
  n = jnp.maximum(n_steps, 1).astype(jnp.float32)
  a = jnp.floor(jax.random.uniform(k_a, n_steps.shape) * n).astype(jnp.int32)
  a = jnp.minimum(a, jnp.maximum(n_steps, 1) - 1)
  span = (n_steps - a).astype(jnp.float32)
  b = a + 1 + jnp.floor(jax.random.uniform(k_b, n_steps.shape) * span).astype(jnp.int32)
  return a, jnp.minimum(b, jnp.maximum(n_steps, 1))


def transition_masks(reveal: jax.Array, answer: jax.Array, a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(masked input positions of s_a, the positions Delta revealed between s_a and s_b), both [B, T] bool."""
  masked = answer & (reveal > a[:, None])
  delta = masked & (reveal <= b[:, None])
  return masked, delta


def compressed_transition_terms(logits: jax.Array, targets: jax.Array, masked: jax.Array,
                                delta: jax.Array) -> dict[str, jax.Array]:
  """The TD terms on one forward of s_a.

  Args:
    logits: [B, T, V] model outputs on s_a.
    targets: [B, T] the golden trajectory's final tokens.
    masked: [B, T] positions masked in s_a.
    delta: [B, T] positions revealed between s_a and s_b (a subset of `masked`).

  Returns:
    nll: sum over Delta of -log p(target) / |Delta| (token mean over the batch: dInfer's compressed
      transition, an ordinary SFT loss on (s_a, tokens of s_b) pairs).
    entropy: mean entropy of the predictive distribution over the masked positions of s_a whose argmax is
      already the golden token (certainty forcing: sharpen what the model gets right, so that more of it
      clears the decoder's threshold in one forward); the correctness mask carries no gradient.
    delta_acc, n_delta, n_correct: metrics.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  ce = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  n_delta = delta.sum()
  nll = jnp.where(delta, ce, 0.0).sum() / jnp.maximum(n_delta, 1)
  correct = jax.lax.stop_gradient((jnp.argmax(logp, -1) == targets) & masked)
  ent = -(jnp.exp(logp) * logp).sum(-1)
  n_correct = correct.sum()
  entropy = jnp.where(correct, ent, 0.0).sum() / jnp.maximum(n_correct, 1)
  delta_acc = (correct & delta).sum() / jnp.maximum(n_delta, 1)
  return {"nll": nll, "entropy": entropy, "delta_acc": delta_acc, "n_delta": n_delta.astype(jnp.float32),
          "n_correct": n_correct.astype(jnp.float32)}


def td_loss(params, batch: dict, rng: jax.Array, *, cfg: ModelConfig, mask_id: int, mdm_weight: float = 0.0,
            cf_weight: float = 0.0, eps: float = 1e-3, moe_impl: str | None = "dense",
            remat: bool = False) -> tuple[jax.Array, dict]:
  """Trajectory-distillation loss: compressed-transition NLL + cf_weight * certainty-forcing entropy
  (+ mdm_weight * the masked-diffusion loss on the same rows' final answers, a second forward).

  `batch` (train_td.td_data): tokens, valid, positions, answer as in the masked-diffusion batch, plus
  reveal [B, T] int32 and n_steps [B] int32.
  """
  k_tr, k_mdm = jax.random.split(rng)
  tokens, answer = batch["tokens"], batch["answer"]
  a, b = sample_transition(k_tr, batch["n_steps"])
  masked, delta = transition_masks(batch["reveal"], answer, a, b)
  state = jnp.where(masked, mask_id, tokens)
  logits = forward(params, cfg, state, positions=batch["positions"], mask=batch["valid"], moe_impl=moe_impl,
                   remat=remat).logits
  terms = compressed_transition_terms(logits, tokens, masked, delta)
  loss = terms["nll"] + cf_weight * terms["entropy"]
  metrics = {"td_nll": terms["nll"], "cf_entropy": terms["entropy"], "delta_acc": terms["delta_acc"],
             "delta_tokens": terms["n_delta"], "masked_acc": terms["delta_acc"]}
  if mdm_weight:
    mdm, mdm_metrics = masked_diffusion_loss(params, batch, k_mdm, cfg=cfg, mask_id=mask_id, eps=eps,
                                             moe_impl=moe_impl, remat=remat)
    loss = loss + mdm_weight * mdm
    metrics["mdm_loss"] = mdm
    metrics["mdm_masked_acc"] = mdm_metrics["masked_acc"]
  return loss, dict(metrics, loss=loss)


def make_td_loss_fn(cfg: ModelConfig, *, mdm_weight: float = 0.0, cf_weight: float = 0.0, eps: float = 1e-3,
                    moe_impl: str | None = "dense", remat: bool = False, compute_dtype: str | None = None) -> LossFn:
  """The trajectory-distillation loss bound to a model config: loss_fn(params, batch, rng). remat and
  compute_dtype as in make_loss_fn."""
  return mixed_precision(functools.partial(td_loss, cfg=cfg, mask_id=cfg.mask_token_id, mdm_weight=mdm_weight,
                                           cf_weight=cf_weight, eps=eps, moe_impl=moe_impl, remat=remat),
                         compute_dtype)
