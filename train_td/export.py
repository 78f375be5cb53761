"""Export a trained run as an HF checkpoint directory shaped like a real LLaDA-MoE release.

Output: config.json (model_type "llada", architectures ["LLaDAMoEModelLM"]), model.safetensors (+ index),
tokenizer files (train_td.tokenizer.save_tokenizer) and generation_config.json holding the dinfer-jax
GenerationConfig defaults for this model. The weights go through the project's checkpoint code:
save_converted (orbax) then jax2hf (the one key map), so the directory loads with dinfer_jax.load().
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile
from typing import Any, Mapping

import jax
import ml_dtypes
import numpy as np

from dinfer_jax import api, checkpoint
from dinfer_jax.checkpoint import outdir
from dinfer_jax.config import ModelConfig
from dinfer_jax.model import params as params_lib
from dinfer_jax.tasks import get_task
from train_td import tokenizer as tok_lib, trainer

# GenerationConfig knobs the shipped model is meant to be decoded with. gen_length is the training answer
# region (TrainConfig.answer_len, 8; export_run follows a run's own): the model has only learned to fill that
# many positions. One block of 8: with the dual cache every block costs a refresh plus the cached forward
# owed after it, so two blocks of 4 cap a 4-character answer at 1 token per forward; one block of 8 halves
# the forwards and was also more accurate (sort retrain, 200 held-out problems: arithmetic 0.940 at TPF 1.97
# vs 0.925 at 0.99, program 0.705 at 2.71 vs 0.690 at 1.40). Long answers are block-wise through their
# prompt rules below.
DEFAULT_GENERATION = {"gen_length": 8, "block_length": 8, "decoder": "threshold", "threshold": 0.9,
                      "cache": "dual", "prompt_bucket": 16}
# Prompt rules (dinfer_jax.cli_common.PROMPT_RULES) of the long-answer tasks, written for a run that trained them:
# sort answers are up to 47 characters + <|eos|> (the task's answer region, data.DEFAULT_TASK_ANSWER_LEN),
# six blocks of 8, long sums 25 + <|eos|> in four blocks of 8, so a user's long list or sum is never cut
# off at the short default.
TASK_PROMPT_RULES = {"sort": {"prefix": "<|user|>sort:", "gen_length": 48, "block_length": 8},
                     "add": {"prefix": "<|user|>add:", "gen_length": 32, "block_length": 8}}


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
  """config.json of an HF LLaDA-MoE release for a llada_moe ModelConfig."""
  if cfg.family != "llada_moe":
    raise ValueError(f"hf_config: only family 'llada_moe' is exported, got {cfg.family!r}")
  return {
      "architectures": ["LLaDAMoEModelLM"],
      "model_type": "llada",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "num_experts": cfg.n_experts,
      "num_experts_per_tok": cfg.n_experts_per_tok,
      "expert_intermediate_size": cfg.expert_ffn_dim,
      "intermediate_size": cfg.expert_ffn_dim,
      "shared_expert_intermediate_size": None,
      "norm_topk_prob": False,
      "qk_layernorm": cfg.qk_norm,
      "hidden_act": "silu",
      "rope_theta": cfg.rope_theta,
      "partial_rotary_factor": 1.0,
      "rms_norm_eps": cfg.rms_eps,
      "max_position_embeddings": cfg.max_position,
      "tie_word_embeddings": False,
      "attention_bias": False,
      "clip_qkv": None,
      "mask_token_id": cfg.mask_token_id,
      "eos_token_id": cfg.eos_token_id,
      "pad_token_id": cfg.pad_token_id if cfg.pad_token_id is not None else tok_lib.PAD_ID,
      "torch_dtype": dtype,
  }


def check_out(out: os.PathLike, *, overwrite: bool = False) -> bool:
  """Refuses an export destination that exists, unless overwrite=True and it is a model directory (an HF
  checkpoint, e.g. the shipped default model) or an earlier dinfer-jax output. Returns whether an existing
  model directory will be replaced."""
  out = pathlib.Path(out)
  replace_model = overwrite and checkpoint.is_hf_checkpoint(out)
  outdir.check_destination(out, overwrite=overwrite, replace_unmarked=replace_model)
  return replace_model


def export_params(params, cfg: ModelConfig, out: os.PathLike, *, dtype: str = "float32",
                  generation_config: Mapping[str, Any] | None = None, overwrite: bool = False,
                  like: str | os.PathLike | None = None, allow_nonfinite: bool = False) -> dict[str, Any]:
  """Writes params + config + tokenizer + generation_config.json to `out`.

  like: a model directory (or "default") whose format to write: its config.json (torch_dtype set to
  `dtype`), tokenizer, chat template and other non-weight files; generation_config.json is its own unless
  `generation_config` is given. Without it: train_td's format (hf_config(cfg), the character tokenizer,
  DEFAULT_GENERATION unless given).

  An existing `out` is replaced only as check_out allows: `--out .` never empties the working directory.
  Weights holding NaN/inf are refused (allow_nonfinite: written anyway).
  """
  bad = [] if allow_nonfinite else params_lib.nonfinite_weights(params)
  if bad:
    raise ValueError(f"export: the checkpoint {params_lib.describe_nonfinite(bad)} (--allow-nonfinite to "
                     "export it anyway)")
  np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  if like is not None:
    like_cfg, hf = api.load_config(like)
    if dataclasses.replace(like_cfg, moe_impl=cfg.moe_impl) != cfg:
      raise ValueError(f"export: the params are a {cfg} model, {like} a {like_cfg} one")
    hf = dict(hf, torch_dtype=dtype)
  else:
    hf = hf_config(cfg, dtype)
  host = jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x), np.float32).astype(np_dtype), params)
  out = pathlib.Path(out)
  # Refuse before any work: an existing out without overwrite, or one that is not a model.
  replace_model = check_out(out, overwrite=overwrite)
  out.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix="train_td_export_") as tmp:
    aux = pathlib.Path(tmp) / "aux"
    aux.mkdir()
    if like is not None:
      checkpoint.converted.copy_aux_files(api.resolve_path(like), aux)
    else:
      tok_lib.save_tokenizer(aux)
      generation_config = DEFAULT_GENERATION if generation_config is None else generation_config
    if generation_config is not None:
      (aux / "generation_config.json").write_text(json.dumps(dict(generation_config), indent=2) + "\n")
    conv = pathlib.Path(tmp) / "converted"
    checkpoint.save_converted(conv, host, hf, src_dir_for_tokenizer=aux, source_dtype=dtype)
    summary = checkpoint.jax2hf(conv, out, dtype=dtype, overwrite=overwrite, replace_unmarked=replace_model)
  return {"path": str(out), "n_params": summary["n_params"], "bytes": summary["bytes"], "dtype": dtype,
          "files": sorted(p.name for p in out.iterdir() if not p.name.startswith("."))}


def run_generation_config(tc) -> dict[str, Any]:
  """generation_config.json for a trained run: the defaults with gen_length = the run's answer region, a
  prompt rule for each long-answer task of its mix, and the tasks it was trained on."""
  gen = dict(DEFAULT_GENERATION)
  if tc.answer_len != DEFAULT_GENERATION["gen_length"]:
    gen.update(gen_length=tc.answer_len, block_length=tc.answer_len)
  rules = [TASK_PROMPT_RULES[name] for name, w in tc.mix if w > 0 and name in TASK_PROMPT_RULES]
  if rules:
    gen["prompt_rules"] = rules
  # The built-in tasks it learned: `dinfer-jax generate` warns about a prompt outside all of them.
  gen["trained_tasks"] = [name for name, w in tc.mix if w > 0 and not get_task(name).chat]
  return gen


def export_run(run_dir: os.PathLike, out: os.PathLike, *, step: int | None = None, dtype: str = "float32",
               generation_config: Mapping[str, Any] | None = None, overwrite: bool = False,
               allow_nonfinite: bool = False) -> dict[str, Any]:
  """Exports a run's checkpoint (latest unless `step`) to `out` (see export_params for `overwrite`); a run
  with arch_from (a TD run) in its model's format, with its tokenizer and generation defaults."""
  tc = trainer.load_train_config(run_dir)
  if generation_config is None and not tc.arch_from:
    generation_config = run_generation_config(tc)
  params, _, s = trainer.restore(run_dir, tc, step)
  res = export_params(params, tc.model_config(), out, dtype=dtype, generation_config=generation_config,
                      overwrite=overwrite, like=tc.arch_from or None, allow_nonfinite=allow_nonfinite)
  res["step"] = s
  return res
