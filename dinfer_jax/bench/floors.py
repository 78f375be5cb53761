"""Byte and FLOP floors of one forward: what a forward must move and compute at least (the roofline bench's
floor, the GPU check's fraction of the roofline)."""
from __future__ import annotations

from dinfer_jax.config import ModelConfig


def bytes_per_forward(cfg: ModelConfig, *, dtype_bytes: int, batch: int, tokens: int, kv_len: int,
                      logits_tokens: int, quant_bytes: float | None = None,
                      head_bytes: float | None = None) -> dict[str, float]:
  """Bytes one forward must move from HBM at least.

  quant_bytes: bytes per element of the attention projections, FFN and expert kernels when they are stored
  quantised (model/quant.py: 1, scales not counted: < 1% at 128-wide tiles); default dtype_bytes.
  head_bytes: the same for the LM head (quantised only on request: QuantConfig.lm_head).
  weights: attention (q, k, v, o), norms, router, the touched experts of every layer, the LM head;
  embed: the looked-up rows; kv: the K/V of every layer the forward attends to (read) plus its own K/V.
  Expected distinct experts per layer for n tokens, each routed to k of E uniformly: E * (1 - (1 - k/E)^n)
  (a token misses a given expert with probability 1 - k/E). It matters where n * k is near E: LLaDA2-mini's
  block of 32 at batch 1 touches about 163 of its 256 experts, not all."""
  D, N, K, H, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
  q = dtype_bytes if quant_bytes is None else quant_bytes  # the matmul kernels' bytes per element
  attn = (D * N * H * 2 + D * K * H * 2) * q + (2 * D + (2 * H if cfg.qk_norm else 0)) * dtype_bytes
  per_layer = attn
  touched = 0.0
  moe = 0.0
  if cfg.n_moe_layers:
    touched = cfg.n_experts * (1.0 - (1.0 - cfg.n_experts_per_tok / cfg.n_experts) ** (batch * tokens))
    expert = 3 * D * cfg.expert_ffn_dim
    moe = D * cfg.n_experts * dtype_bytes + (touched * expert + 3 * D * cfg.shared_expert_ffn_dim) * q
  dense = 3 * D * cfg.ffn_dim * q
  weights = (cfg.n_dense_layers * (per_layer + dense) + cfg.n_moe_layers * (per_layer + moe)
             + D * dtype_bytes + D * V * (dtype_bytes if head_bytes is None else head_bytes))
  embed = batch * tokens * D * dtype_bytes
  kv = 2 * cfg.n_layers * batch * (kv_len + tokens) * K * H * dtype_bytes
  return {"weights": weights, "embed": embed, "kv": kv, "total": weights + embed + kv,
          "experts_touched_per_layer": touched, "logits_tokens": logits_tokens}


def flops_per_forward(cfg: ModelConfig, *, batch: int, tokens: int, kv_len: int, logits_tokens: int) -> float:
  """Matmul FLOPs of one forward (routed experts only; attention over kv_len keys)."""
  D, N, K, H, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
  proj = 2 * D * (2 * N * H + 2 * K * H)
  att = 2 * 2 * kv_len * N * H
  ffn_dense = 2 * 3 * D * cfg.ffn_dim
  ffn_moe = 2 * D * cfg.n_experts + 2 * 3 * D * cfg.expert_ffn_dim * cfg.n_experts_per_tok + 2 * 3 * D * cfg.shared_expert_ffn_dim
  per_tok = cfg.n_dense_layers * (proj + att + ffn_dense) + cfg.n_moe_layers * (proj + att + ffn_moe)
  return batch * (tokens * per_tok + logits_tokens * 2 * D * V)
