"""ModelConfig: one frozen description of LLaDA-MoE, dense LLaDA and LLaDA2-MoE."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Mapping

Family = Literal["llada_moe", "llada", "llada2_moe"]
FAMILIES = ("llada_moe", "llada", "llada2_moe")
MOE_IMPLS = ("auto", "dense", "ragged", "grouped")
DECODINGS = ("masked", "block")
ROUTERS = ("softmax", "sigmoid_grouped", "sigmoid_block")


class ConfigError(ValueError):
  """A model config that is unknown, incomplete or inconsistent; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture hyperparameters. Dimension letters: D model, F ffn, N heads, K kv heads, H head dim,
  E experts, V vocab. Layers [0, n_dense_layers) are dense SwiGLU, the rest are MoE."""

  family: Family
  vocab_size: int  # V
  d_model: int  # D
  n_layers: int
  n_heads: int  # N
  n_kv_heads: int  # K
  head_dim: int  # H
  ffn_dim: int = 0  # F of the dense layers
  n_dense_layers: int = 0
  n_experts: int = 0  # E
  n_experts_per_tok: int = 0  # top-k
  expert_ffn_dim: int = 0
  shared_expert_ffn_dim: int = 0  # 0 = no shared expert
  # "softmax": LLaDA-MoE, softmax over all experts, top-k, no renormalisation.
  # "sigmoid_grouped": LLaDA2.0/2.1, sigmoid + bias for selection, group-limited, renormalised, scaled.
  # "sigmoid_block": LLaDA2.2's block routing: per aligned block of router_block positions the experts whose
  # best biased score over the block's tokens is among the top expert_capacity are admitted, then each token
  # takes its top-k of those; weights as sigmoid_grouped's.
  router: Literal["softmax", "sigmoid_grouped", "sigmoid_block"] = "softmax"
  n_groups: int = 1
  topk_groups: int = 1
  router_block: int = 0  # sigmoid_block: positions per routing block (LLaDA2.2's block_size, 32)
  expert_capacity: int = 0  # sigmoid_block: experts admitted per routing block (LLaDA2.2: 48)
  routed_scaling_factor: float = 1.0
  router_bias: bool = False  # LLaDA2's expert_bias: added to the scores for selection only
  qk_norm: bool = False
  rope_theta: float = 10000.0
  rotary_dim: int = 0  # 0 means the full head_dim
  rms_eps: float = 1e-5
  max_position: int = 4096
  mask_token_id: int = 0
  eos_token_id: int = 0
  # Every token that ends an answer (LLaDA2.2 adds <|role_end|>): eos_token_id first; () means (eos_token_id,).
  stop_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  # Which MoE kernel the forward uses. "auto" picks by backend and token count (see model/moe.py).
  moe_impl: str = "auto"
  # How the model generates: "masked" diffusion over the whole canvas (LLaDA, LLaDA-MoE: bidirectional
  # attention) or "block" diffusion (LLaDA2: block-causal attention, a KV cache that persists across blocks).
  # None: the family's (block for llada2_moe).
  decoding: Literal["masked", "block"] | None = None

  def __post_init__(self):
    def need(cond, field, msg):
      if not cond:
        raise ConfigError(f"ModelConfig.{field}: {msg} (got {getattr(self, field)!r})")

    need(self.family in FAMILIES, "family", f"must be one of {FAMILIES}")
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "max_position"):
      need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
    need(self.n_heads % self.n_kv_heads == 0, "n_kv_heads", f"must divide n_heads={self.n_heads}")
    need(0 <= self.n_dense_layers <= self.n_layers, "n_dense_layers", f"must be in [0, n_layers={self.n_layers}]")
    if self.n_dense_layers > 0:
      need(self.ffn_dim > 0, "ffn_dim", "dense layers need a positive ffn_dim")
    if self.n_moe_layers > 0:
      need(self.n_experts > 0, "n_experts", "MoE layers need experts")
      need(0 < self.n_experts_per_tok <= self.n_experts, "n_experts_per_tok", f"must be in [1, n_experts={self.n_experts}]")
      need(self.expert_ffn_dim > 0, "expert_ffn_dim", "MoE layers need a positive expert_ffn_dim")
      need(self.n_groups > 0 and self.n_experts % self.n_groups == 0, "n_groups", f"must divide n_experts={self.n_experts}")
      need(0 < self.topk_groups <= self.n_groups, "topk_groups", f"must be in [1, n_groups={self.n_groups}]")
      if self.router == "sigmoid_grouped":
        need(self.topk_groups * (self.n_experts // self.n_groups) >= self.n_experts_per_tok, "topk_groups",
             "the kept groups must hold at least n_experts_per_tok experts")
    need(self.router in ROUTERS, "router", f"must be one of {ROUTERS}")
    if self.router == "sigmoid_block":
      need(self.router_block > 0, "router_block", "block routing needs a positive router_block")
      need(self.n_experts_per_tok <= self.expert_capacity <= self.n_experts, "expert_capacity",
           f"must be in [n_experts_per_tok={self.n_experts_per_tok}, n_experts={self.n_experts}]")
    need(self.shared_expert_ffn_dim >= 0, "shared_expert_ffn_dim", "must be >= 0")
    need(0 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0, "rotary_dim",
         f"must be even and in [0, head_dim={self.head_dim}]")
    for f in ("rope_theta", "rms_eps", "routed_scaling_factor"):
      need(math.isfinite(getattr(self, f)) and getattr(self, f) > 0, f, "must be a positive finite number")
    for f in ("mask_token_id", "eos_token_id"):
      need(0 <= getattr(self, f) < self.vocab_size, f, f"must be a token id in [0, vocab_size={self.vocab_size})")
    need(self.moe_impl in MOE_IMPLS, "moe_impl", f"must be one of {MOE_IMPLS}")
    stops = tuple(int(t) for t in self.stop_token_ids) or (self.eos_token_id,)
    stops = (self.eos_token_id,) + tuple(t for t in dict.fromkeys(stops) if t != self.eos_token_id)
    object.__setattr__(self, "stop_token_ids", stops)
    need(all(0 <= t < self.vocab_size for t in stops), "stop_token_ids",
         f"must be token ids in [0, vocab_size={self.vocab_size})")
    if self.decoding is None:
      object.__setattr__(self, "decoding", "block" if self.family == "llada2_moe" else "masked")
    need(self.decoding in DECODINGS, "decoding", f"must be one of {DECODINGS}")

  @property
  def n_moe_layers(self) -> int:
    return self.n_layers - self.n_dense_layers

  @property
  def rope_dim(self) -> int:
    return self.rotary_dim or self.head_dim

  @property
  def block_diffusion(self) -> bool:
    return self.decoding == "block"

  @property
  def kv_groups(self) -> int:
    return self.n_heads // self.n_kv_heads

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  # ------------------------------------------------------------------ presets (released hyperparameters)
  @classmethod
  def llada_moe_7b_a1b(cls) -> "ModelConfig":
    return cls(family="llada_moe", vocab_size=157184, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16,
               head_dim=128, n_experts=64, n_experts_per_tok=8, expert_ffn_dim=1024, router="softmax",
               qk_norm=True, rope_theta=50000.0, rms_eps=1e-5, max_position=8192,
               mask_token_id=156895, eos_token_id=156892, pad_token_id=156892)

  @classmethod
  def llada_8b(cls) -> "ModelConfig":
    return cls(family="llada", vocab_size=126464, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
               head_dim=128, ffn_dim=12288, n_dense_layers=32, rope_theta=500000.0, rms_eps=1e-5,
               max_position=4096, mask_token_id=126336, eos_token_id=126081, pad_token_id=126081)

  @classmethod
  def llada2_mini(cls) -> "ModelConfig":
    return cls(family="llada2_moe", vocab_size=157184, d_model=2048, n_layers=20, n_heads=16, n_kv_heads=4,
               head_dim=128, ffn_dim=5120, n_dense_layers=1, n_experts=256, n_experts_per_tok=8,
               expert_ffn_dim=512, shared_expert_ffn_dim=512, router="sigmoid_grouped", n_groups=8,
               topk_groups=4, routed_scaling_factor=2.5, router_bias=True, qk_norm=True, rope_theta=600000.0, rotary_dim=64,
               rms_eps=1e-6, max_position=16384, mask_token_id=156895, eos_token_id=156892,
               pad_token_id=156892)

  # ------------------------------------------------------------------ HF config.json
  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any], **overrides) -> "ModelConfig":
    """Recognises LLaDA-MoE (model_type 'llada' + num_experts), dense LLaDA ('llada' + d_model) and LLaDA2-MoE."""
    if not isinstance(hf, Mapping):
      raise ConfigError(f"config.json must be a JSON object, got {type(hf).__name__}")
    mt = hf.get("model_type")
    if mt == "llada" and "num_experts" in hf:
      cfg = _from_llada_moe(hf)
    elif mt == "llada" and "d_model" in hf:
      cfg = _from_llada_dense(hf)
    elif mt == "llada2_moe":
      cfg = _from_llada2(hf)
    elif mt == "llada":
      raise ConfigError("config.json: model_type 'llada' has neither 'num_experts' (LLaDA-MoE) nor 'd_model' (dense LLaDA)")
    else:
      raise ConfigError(f"config.json: unknown model_type {mt!r}; expected 'llada' (LLaDA-MoE or dense LLaDA) or 'llada2_moe'")
    cfg.update(overrides)
    return cls(**cfg)


def _get(hf, key, default=dataclasses.MISSING, *, typ=None, positive: bool = False):
  if key not in hf or hf[key] is None:
    if default is dataclasses.MISSING:
      raise ConfigError(f"config.json: required field {key!r} is missing")
    return default
  v = hf[key]
  if typ is int and not (isinstance(v, int) and not isinstance(v, bool)):
    raise ConfigError(f"config.json: field {key!r} must be an int, got {v!r}")
  if typ is float and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
    raise ConfigError(f"config.json: field {key!r} must be a finite number, got {v!r}")
  if positive and not v > 0:
    raise ConfigError(f"config.json: field {key!r} must be positive, got {v!r}")
  return v


def _tokens(hf, mask_default, eos_default):
  eos = hf.get("eos_token_id", eos_default)
  stops = tuple(eos) if isinstance(eos, list) else ()
  if isinstance(eos, list):
    eos = eos[0] if eos else None
  return dict(mask_token_id=_get(hf, "mask_token_id", mask_default, typ=int),
              eos_token_id=eos if eos is not None else eos_default, stop_token_ids=stops,
              pad_token_id=hf.get("pad_token_id"))


def _from_llada_moe(hf):
  d, n = _get(hf, "hidden_size", typ=int, positive=True), _get(hf, "num_attention_heads", typ=int, positive=True)
  if d % n:
    raise ConfigError(f"config.json: hidden_size={d} is not divisible by num_attention_heads={n}")
  prf = _get(hf, "partial_rotary_factor", 1.0, typ=float)
  if prf != 1.0:
    raise ConfigError(f"config.json: partial_rotary_factor={prf} is not supported for LLaDA-MoE (must be 1.0)")
  if hf.get("shared_expert_intermediate_size") not in (None, 0):
    raise ConfigError("config.json: shared_expert_intermediate_size must be null for LLaDA-MoE "
                      f"(got {hf['shared_expert_intermediate_size']!r})")
  if hf.get("moe_router_enable_expert_bias"):
    raise ConfigError("config.json: moe_router_enable_expert_bias=true is not supported for LLaDA-MoE "
                      "(dInfer ignores the bias; refusing to guess)")
  if hf.get("clip_qkv") is not None:
    raise ConfigError(f"config.json: clip_qkv={hf['clip_qkv']!r} is not supported (must be null)")
  if hf.get("rope_scaling") is not None:
    raise ConfigError(f"config.json: rope_scaling={hf['rope_scaling']!r} is not supported (must be null)")
  return dict(family="llada_moe", vocab_size=_get(hf, "vocab_size", typ=int), d_model=d,
              n_layers=_get(hf, "num_hidden_layers", typ=int), n_heads=n,
              n_kv_heads=_get(hf, "num_key_value_heads", n, typ=int), head_dim=d // n,
              n_experts=_get(hf, "num_experts", typ=int), n_experts_per_tok=_get(hf, "num_experts_per_tok", typ=int),
              expert_ffn_dim=_get(hf, "expert_intermediate_size", typ=int), router="softmax",
              qk_norm=bool(hf.get("qk_layernorm", True)), rope_theta=float(_get(hf, "rope_theta", typ=float)),
              rms_eps=float(_get(hf, "rms_norm_eps", 1e-5, typ=float)),
              max_position=_get(hf, "max_position_embeddings", 8192, typ=int),
              **_tokens(hf, 156895, 156892))


def _from_llada_dense(hf):
  d, n = _get(hf, "d_model", typ=int, positive=True), _get(hf, "n_heads", typ=int, positive=True)
  if d % n:
    raise ConfigError(f"config.json: d_model={d} is not divisible by n_heads={n}")
  if hf.get("block_type", "llama") != "llama":
    raise ConfigError(f"config.json: block_type={hf.get('block_type')!r} is not supported (only 'llama')")
  if hf.get("weight_tying"):
    raise ConfigError("config.json: weight_tying=true is not supported (LLaDA ships a separate ff_out head)")
  if hf.get("block_group_size", 1) != 1:
    raise ConfigError(f"config.json: block_group_size={hf.get('block_group_size')!r} is not supported (must be 1)")
  if hf.get("include_bias") or hf.get("include_qkv_bias"):
    raise ConfigError("config.json: include_bias/include_qkv_bias must be false")
  if hf.get("activation_type", "silu") != "silu":
    raise ConfigError(f"config.json: activation_type={hf.get('activation_type')!r} is not supported (only 'silu')")
  vocab = _get(hf, "embedding_size", None) or _get(hf, "vocab_size", typ=int)
  ffn = hf.get("mlp_hidden_size") or _get(hf, "mlp_ratio", typ=int) * d
  nl = _get(hf, "n_layers", typ=int)
  return dict(family="llada", vocab_size=vocab, d_model=d, n_layers=nl, n_heads=n,
              n_kv_heads=hf.get("n_kv_heads") or n, head_dim=d // n, ffn_dim=ffn, n_dense_layers=nl,
              qk_norm=bool(hf.get("attention_layer_norm", False)), rope_theta=float(_get(hf, "rope_theta", typ=float)),
              rms_eps=float(_get(hf, "rms_norm_eps", 1e-5, typ=float)),
              max_position=_get(hf, "max_sequence_length", 4096, typ=int),
              **_tokens(hf, 126336, 126081))


# LLaDA2 config.json keys: what the loader implements (with the values it accepts, checked below) and what
# changes nothing about the forward. Any other key might change the architecture: it is refused by name
# rather than silently ignored (as LLaDA2.2's expert_capacity once was: it would have run group routing).
LLADA2_IMPLEMENTED = frozenset({
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
    "num_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "score_function",
    "moe_router_enable_expert_bias", "rms_norm_eps", "use_qk_norm", "rope_theta", "partial_rotary_factor",
    "rotary_dim", "rope_scaling", "max_position_embeddings", "first_k_dense_replace", "eos_token_id",
    "pad_token_id", "mask_token_id", "tie_word_embeddings", "use_qkv_bias", "use_bias", "num_nextn_predict_layers",
    "expert_capacity", "block_size", "norm_topk_prob", "router_dtype", "hidden_act", "norm_head",
    "use_sliding_window", "quantization_config"})
LLADA2_NO_EFFECT = frozenset({
    "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "use_cache", "initializer_range",
    "attention_dropout", "embedding_dropout", "output_dropout", "output_router_logits", "output_attentions",
    "output_hidden_states", "return_dict", "sliding_window", "max_window_layers", "bos_token_id",
    "delete_token_id", "split_token_id", "tokenizer_class", "_name_or_path", "model_name", "layer_types"})


def _check_llada2_keys(hf) -> None:
  unknown = sorted(k for k in hf if k not in LLADA2_IMPLEMENTED and k not in LLADA2_NO_EFFECT)
  if unknown:
    raise ConfigError(f"config.json: key {unknown[0]!r} is not implemented for LLaDA2 (it may change the "
                      "architecture; refusing to guess)" + (f"; also {unknown[1:]}" if unknown[1:] else ""))
  for key, ok, want in (("tie_word_embeddings", lambda v: not v, "false"), ("norm_head", lambda v: not v, "false"),
                        ("use_sliding_window", lambda v: not v, "false"),
                        ("norm_topk_prob", lambda v: v is None or v, "true"),
                        ("router_dtype", lambda v: v in (None, "fp32", "float32"), "fp32"),
                        ("hidden_act", lambda v: v in (None, "silu"), "silu")):
    if key in hf and not ok(hf[key]):
      raise ConfigError(f"config.json: {key}={hf[key]!r} is not supported for LLaDA2 (must be {want})")


def _from_llada2(hf):
  _check_llada2_keys(hf)
  d, n = _get(hf, "hidden_size", typ=int, positive=True), _get(hf, "num_attention_heads", typ=int, positive=True)
  hd = hf.get("head_dim") or d // n
  prf = float(_get(hf, "partial_rotary_factor", 1.0, typ=float))
  rot = int(hd * prf)
  if hf.get("rope_scaling") is not None:
    raise ConfigError(f"config.json: rope_scaling={hf['rope_scaling']!r} is not supported (must be null)")
  if hf.get("score_function", "sigmoid") != "sigmoid":
    raise ConfigError(f"config.json: score_function={hf.get('score_function')!r} is not supported (only 'sigmoid')")
  if hf.get("use_qkv_bias") or hf.get("use_bias"):
    raise ConfigError("config.json: use_qkv_bias/use_bias must be false")
  if hf.get("num_nextn_predict_layers", 0):
    raise ConfigError("config.json: num_nextn_predict_layers > 0 (MTP) is not supported")
  if hf.get("rotary_dim") is not None and int(hf["rotary_dim"]) != rot:
    raise ConfigError(f"config.json: rotary_dim={hf['rotary_dim']!r} disagrees with head_dim={hd} x "
                      f"partial_rotary_factor={prf}")
  # LLaDA2.2: block routing replaces the group-limited one (its n_group / topk_group stay, unused).
  routing = dict(router="sigmoid_grouped", n_groups=_get(hf, "n_group", 1, typ=int),
                 topk_groups=_get(hf, "topk_group", 1, typ=int))
  if hf.get("expert_capacity") is not None:
    routing = dict(router="sigmoid_block", router_block=_get(hf, "block_size", 32, typ=int),
                   expert_capacity=_get(hf, "expert_capacity", typ=int))
  return dict(family="llada2_moe", vocab_size=_get(hf, "vocab_size", typ=int), d_model=d,
              n_layers=_get(hf, "num_hidden_layers", typ=int), n_heads=n,
              n_kv_heads=_get(hf, "num_key_value_heads", n, typ=int), head_dim=hd,
              ffn_dim=_get(hf, "intermediate_size", typ=int),
              n_dense_layers=_get(hf, "first_k_dense_replace", 0, typ=int),
              n_experts=_get(hf, "num_experts", typ=int), n_experts_per_tok=_get(hf, "num_experts_per_tok", typ=int),
              expert_ffn_dim=_get(hf, "moe_intermediate_size", typ=int),
              shared_expert_ffn_dim=_get(hf, "moe_intermediate_size", typ=int) * _get(hf, "num_shared_experts", 0, typ=int),
              **routing,
              routed_scaling_factor=float(_get(hf, "routed_scaling_factor", 1.0, typ=float)),
              router_bias=bool(hf.get("moe_router_enable_expert_bias", True)),
              qk_norm=bool(hf.get("use_qk_norm", True)), rope_theta=float(_get(hf, "rope_theta", typ=float)),
              rotary_dim=rot if rot != hd else 0, rms_eps=float(_get(hf, "rms_norm_eps", 1e-6, typ=float)),
              max_position=_get(hf, "max_position_embeddings", 16384, typ=int),
              **_tokens(hf, 156895, 156892))
