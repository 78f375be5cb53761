"""Named benchmark shapes: a model config (random weights) and the generation shape it is measured at.

- llada_moe_7b_a1b: the released LLaDA-MoE-7B-A1B hyperparameters, prompt 256 + gen 1024, block 64 (the
  shape the GPU roofline targets are set at);
- mid: a mid-size random LLaDA-MoE for CPU (hidden 512, 8 layers, 16 experts top-4, vocab 32k; prompt 32,
  gen 128, block 32): big enough that the forward, not the dispatch, dominates on 2 cores;
- llada2_mini: LLaDA2.0/2.1-mini's hyperparameters (16B total, about 1.4B active: 20 layers, 256 experts
  top-8 + 1 shared), prompt 256 + gen 1024, block 32 (LLaDA2's block diffusion; the roofline bench only);
- tiny: the GPU check's tiny config (tests and smoke runs); tiny_llada2: a tiny LLaDA2 (block diffusion) for
  the roofline bench's tests.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from dinfer_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Preset:
  model: Callable[[], ModelConfig]
  prompt_length: int
  gen_length: int
  block_length: int

  def __post_init__(self):
    for name in ("prompt_length", "gen_length", "block_length"):
      if getattr(self, name) <= 0:
        raise ValueError(f"Preset.{name}={getattr(self, name)}: must be positive")


def tiny_config() -> ModelConfig:
  return ModelConfig(family="llada_moe", vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                     head_dim=16, n_experts=8, n_experts_per_tok=2, expert_ffn_dim=32, qk_norm=True,
                     rope_theta=50000.0, max_position=512, mask_token_id=509, eos_token_id=506)


def mid_config() -> ModelConfig:
  return ModelConfig(family="llada_moe", vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=8,
                     head_dim=64, n_experts=16, n_experts_per_tok=4, expert_ffn_dim=512, qk_norm=True,
                     rope_theta=50000.0, max_position=1024, mask_token_id=31999, eos_token_id=31998,
                     pad_token_id=31998)


def tiny_llada2_config() -> ModelConfig:
  return ModelConfig(family="llada2_moe", vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=16, ffn_dim=128, n_dense_layers=1, n_experts=8, n_experts_per_tok=2,
                     expert_ffn_dim=32, shared_expert_ffn_dim=32, router="sigmoid_grouped", n_groups=4,
                     topk_groups=2, routed_scaling_factor=2.5, router_bias=True, qk_norm=True, rope_theta=600000.0,
                     rotary_dim=8, max_position=512, mask_token_id=509, eos_token_id=506, pad_token_id=506)


PRESETS: dict[str, Preset] = {
    "llada_moe_7b_a1b": Preset(ModelConfig.llada_moe_7b_a1b, prompt_length=256, gen_length=1024, block_length=64),
    "llada2_mini": Preset(ModelConfig.llada2_mini, prompt_length=256, gen_length=1024, block_length=32),
    "mid": Preset(mid_config, prompt_length=32, gen_length=128, block_length=32),
    "tiny": Preset(tiny_config, prompt_length=16, gen_length=64, block_length=16),
    "tiny_llada2": Preset(tiny_llada2_config, prompt_length=16, gen_length=64, block_length=16),
}


def get(name: str) -> Preset:
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
  return PRESETS[name]
