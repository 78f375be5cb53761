"""dinfer-jax: fast inference and trajectory-distillation training of diffusion LLMs in JAX.

Public API:
  load(path=None, *, dtype="float32", mesh=None) -> Model      (None / "default": the embedded model)
  forward(model, token_ids) -> fp32 logits [B, T, V]
  generate(model, prompts, config, *, seed=0) -> GenerationResult
  ModelConfig, GenerationConfig, make_mesh
"""
from dinfer_jax.api import Model, forward, load
from dinfer_jax.config import ConfigError, ModelConfig
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.generate import GenerationResult, generate
from dinfer_jax.sharding import make_mesh

__version__ = "0.1.0"
__all__ = ["ConfigError", "GenerationConfig", "GenerationResult", "Model", "ModelConfig", "forward", "generate",
           "load", "make_mesh"]
