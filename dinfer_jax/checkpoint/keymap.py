"""The HF <-> JAX key map, as one table per model family.

Each `Rule` says: the HF tensor named by `hf` (a template; `{i}` is the HF layer index, `{e}` the expert
index) becomes the piece(s) `targets` of the param tree (see dinfer_jax/model/params.py for the layout),
through the invertible `transform`. Layer rules land in `dense_layers` for HF layers < n_dense_layers and
in `moe_layers` (at layer index i - n_dense_layers) for the others; `layers` restricts a rule to one kind.

Transforms (torch Linear weights are [out, in], our kernels [in, out], heads split out):
  copy       x -> x                                   norms, embeddings, expert_bias
  linear     [out, in] -> [in, out]                   router, MLP/expert gate/up/down, lm_head
  heads_in   [N*H, D] -> [D, N, H]                    q/k/v projections
  heads_out  [D, N*H] -> [N, H, D]                    attention output projection
  qkv        [(N+2K)*H, D] -> q [D,N,H], k,v [D,K,H]  LLaDA2 packed rows: all q heads | all k | all v
  fused_w13  [E, 2F, D] -> gate, up [E, D, F]         dInfer fused experts: w1 = stack_e(cat(gate_e, up_e))
  fused_w2   [E, D, F] -> down [E, F, D]              w2 = stack_e(down_e)

Layouts: 'per_expert' (the HF release: one tensor per expert and projection) and 'fused' (dInfer's
tools/transfer.py output: mlp.w1/w2 per layer). Dense LLaDA has no experts; it is always 'per_expert'.

`plan(cfg, layout)` expands the table into one `Entry` per HF tensor, and checks that the entries cover
every element of every param exactly once; the loader, the writer (jax2hf) and `expected_hf_keys` all use
that plan, so the two directions cannot drift apart.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Sequence

import jax
import numpy as np

from dinfer_jax.checkpoint.errors import CheckpointError
from dinfer_jax.config import ModelConfig
from dinfer_jax.model.params import FP32_PARAMS, abstract_params

LAYOUTS = ("per_expert", "fused")


# ------------------------------------------------------------------------------------------ transforms
class Transform:
  """An invertible map between one HF tensor and one or more pieces of params.

  Shapes of the pieces come from the param tree (the leaf shape without the indexed leading dims); the HF
  shape is derived from them, so the table needs no per-family shape code.
  """
  name = ""
  n_pieces = 1

  def hf_shape(self, ps: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    raise NotImplementedError

  def to_jax(self, x: np.ndarray, ps: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """HF tensor -> pieces; views where possible, so the caller's assignment does the single copy."""
    raise NotImplementedError

  def to_hf(self, pieces: Sequence[np.ndarray]) -> np.ndarray:
    raise NotImplementedError


class _Copy(Transform):
  name = "copy"

  def hf_shape(self, ps):
    return tuple(ps[0])

  def to_jax(self, x, ps):
    return [x]

  def to_hf(self, pieces):
    return pieces[0]


class _Linear(Transform):
  name = "linear"

  def hf_shape(self, ps):
    return tuple(ps[0][::-1])

  def to_jax(self, x, ps):
    return [x.T]

  def to_hf(self, pieces):
    return pieces[0].T


class _HeadsIn(Transform):
  name = "heads_in"

  def hf_shape(self, ps):
    d, n, h = ps[0]
    return (n * h, d)

  def to_jax(self, x, ps):
    return [x.T.reshape(ps[0])]

  def to_hf(self, pieces):
    d, n, h = pieces[0].shape
    return pieces[0].reshape(d, n * h).T


class _HeadsOut(Transform):
  name = "heads_out"

  def hf_shape(self, ps):
    n, h, d = ps[0]
    return (d, n * h)

  def to_jax(self, x, ps):
    return [x.T.reshape(ps[0])]

  def to_hf(self, pieces):
    n, h, d = pieces[0].shape
    return pieces[0].reshape(n * h, d).T


class _Qkv(Transform):
  name = "qkv"
  n_pieces = 3

  def hf_shape(self, ps):
    rows = sum(n * h for _, n, h in ps)
    return (rows, ps[0][0])

  def to_jax(self, x, ps):
    out, r = [], 0
    for p in ps:
      rows = p[1] * p[2]
      out.append(x[r:r + rows].T.reshape(p))
      r += rows
    return out

  def to_hf(self, pieces):
    return np.concatenate([_HeadsIn().to_hf([p]) for p in pieces], axis=0)


class _FusedW13(Transform):
  name = "fused_w13"
  n_pieces = 2

  def hf_shape(self, ps):
    e, d, f = ps[0]
    return (e, 2 * f, d)

  def to_jax(self, x, ps):
    f = ps[0][2]
    return [x[:, :f].transpose(0, 2, 1), x[:, f:].transpose(0, 2, 1)]

  def to_hf(self, pieces):
    return np.concatenate([p.transpose(0, 2, 1) for p in pieces], axis=1)


class _FusedW2(Transform):
  name = "fused_w2"

  def hf_shape(self, ps):
    e, f, d = ps[0]
    return (e, d, f)

  def to_jax(self, x, ps):
    return [x.transpose(0, 2, 1)]

  def to_hf(self, pieces):
    return pieces[0].transpose(0, 2, 1)


TRANSFORMS: dict[str, Transform] = {t.name: t for t in (_Copy(), _Linear(), _HeadsIn(), _HeadsOut(), _Qkv(),
                                                         _FusedW13(), _FusedW2())}


# ------------------------------------------------------------------------------------------- the table
@dataclasses.dataclass(frozen=True)
class Rule:
  """HF key template -> param piece(s).

  hf: template; `{i}` = HF layer index, `{e}` = expert index.
  targets: param paths, dotted. For layer rules relative to the layer group ('q', 'experts.gate').
  transform: a TRANSFORMS key.
  layers: 'global' (not per layer), 'all', 'dense' or 'moe' (which HF layers the rule exists for).
  layout: 'any', 'per_expert' or 'fused'.
  needs: a ModelConfig attribute that must be truthy for the tensor to exist ('qk_norm', ...).
  """
  hf: str
  targets: tuple[str, ...]
  transform: str
  layers: str = "all"
  layout: str = "any"
  needs: str | None = None

  @property
  def regex(self) -> re.Pattern:
    return _template_regex(self.hf)


@functools.lru_cache(maxsize=None)
def _template_regex(template: str) -> re.Pattern:
  return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)"))


LLADA_MOE_RULES: tuple[Rule, ...] = (
    Rule("model.embed_tokens.weight", ("embed",), "copy", "global"),
    Rule("model.norm.weight", ("final_norm",), "copy", "global"),
    Rule("lm_head.weight", ("lm_head",), "linear", "global"),
    Rule("model.layers.{i}.input_layernorm.weight", ("attn_norm",), "copy"),
    Rule("model.layers.{i}.self_attn.q_proj.weight", ("q",), "heads_in"),
    Rule("model.layers.{i}.self_attn.k_proj.weight", ("k",), "heads_in"),
    Rule("model.layers.{i}.self_attn.v_proj.weight", ("v",), "heads_in"),
    Rule("model.layers.{i}.self_attn.o_proj.weight", ("o",), "heads_out"),
    Rule("model.layers.{i}.self_attn.q_norm.weight", ("q_norm",), "copy", needs="qk_norm"),
    Rule("model.layers.{i}.self_attn.k_norm.weight", ("k_norm",), "copy", needs="qk_norm"),
    Rule("model.layers.{i}.post_attention_layernorm.weight", ("ffn_norm",), "copy"),
    Rule("model.layers.{i}.mlp.gate.weight", ("router",), "linear", "moe"),
    Rule("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", ("experts.gate",), "linear", "moe", "per_expert"),
    Rule("model.layers.{i}.mlp.experts.{e}.up_proj.weight", ("experts.up",), "linear", "moe", "per_expert"),
    Rule("model.layers.{i}.mlp.experts.{e}.down_proj.weight", ("experts.down",), "linear", "moe", "per_expert"),
    Rule("model.layers.{i}.mlp.w1", ("experts.gate", "experts.up"), "fused_w13", "moe", "fused"),
    Rule("model.layers.{i}.mlp.w2", ("experts.down",), "fused_w2", "moe", "fused"),
)

LLADA_RULES: tuple[Rule, ...] = (
    Rule("model.transformer.wte.weight", ("embed",), "copy", "global"),
    Rule("model.transformer.ln_f.weight", ("final_norm",), "copy", "global"),
    Rule("model.transformer.ff_out.weight", ("lm_head",), "linear", "global"),
    Rule("model.transformer.blocks.{i}.attn_norm.weight", ("attn_norm",), "copy"),
    Rule("model.transformer.blocks.{i}.q_proj.weight", ("q",), "heads_in"),
    Rule("model.transformer.blocks.{i}.k_proj.weight", ("k",), "heads_in"),
    Rule("model.transformer.blocks.{i}.v_proj.weight", ("v",), "heads_in"),
    Rule("model.transformer.blocks.{i}.attn_out.weight", ("o",), "heads_out"),
    Rule("model.transformer.blocks.{i}.ff_norm.weight", ("ffn_norm",), "copy"),
    Rule("model.transformer.blocks.{i}.ff_proj.weight", ("mlp.gate",), "linear", "dense"),
    Rule("model.transformer.blocks.{i}.up_proj.weight", ("mlp.up",), "linear", "dense"),
    Rule("model.transformer.blocks.{i}.ff_out.weight", ("mlp.down",), "linear", "dense"),
)

LLADA2_RULES: tuple[Rule, ...] = (
    Rule("model.word_embeddings.weight", ("embed",), "copy", "global"),
    Rule("model.norm.weight", ("final_norm",), "copy", "global"),
    Rule("lm_head.weight", ("lm_head",), "linear", "global"),
    Rule("model.layers.{i}.input_layernorm.weight", ("attn_norm",), "copy"),
    Rule("model.layers.{i}.attention.query_key_value.weight", ("q", "k", "v"), "qkv"),
    Rule("model.layers.{i}.attention.query_layernorm.weight", ("q_norm",), "copy", needs="qk_norm"),
    Rule("model.layers.{i}.attention.key_layernorm.weight", ("k_norm",), "copy", needs="qk_norm"),
    Rule("model.layers.{i}.attention.dense.weight", ("o",), "heads_out"),
    Rule("model.layers.{i}.post_attention_layernorm.weight", ("ffn_norm",), "copy"),
    Rule("model.layers.{i}.mlp.gate_proj.weight", ("mlp.gate",), "linear", "dense"),
    Rule("model.layers.{i}.mlp.up_proj.weight", ("mlp.up",), "linear", "dense"),
    Rule("model.layers.{i}.mlp.down_proj.weight", ("mlp.down",), "linear", "dense"),
    Rule("model.layers.{i}.mlp.gate.weight", ("router",), "linear", "moe"),
    # A buffer, kept fp32 on both sides (params.FP32_PARAMS): rounding it would change expert selection.
    Rule("model.layers.{i}.mlp.gate.expert_bias", ("expert_bias",), "copy", "moe", needs="router_bias"),
    Rule("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", ("experts.gate",), "linear", "moe", "per_expert"),
    Rule("model.layers.{i}.mlp.experts.{e}.up_proj.weight", ("experts.up",), "linear", "moe", "per_expert"),
    Rule("model.layers.{i}.mlp.experts.{e}.down_proj.weight", ("experts.down",), "linear", "moe", "per_expert"),
    Rule("model.layers.{i}.mlp.w1", ("experts.gate", "experts.up"), "fused_w13", "moe", "fused"),
    Rule("model.layers.{i}.mlp.w2", ("experts.down",), "fused_w2", "moe", "fused"),
    Rule("model.layers.{i}.mlp.shared_experts.gate_proj.weight", ("shared.gate",), "linear", "moe",
         needs="shared_expert_ffn_dim"),
    Rule("model.layers.{i}.mlp.shared_experts.up_proj.weight", ("shared.up",), "linear", "moe",
         needs="shared_expert_ffn_dim"),
    Rule("model.layers.{i}.mlp.shared_experts.down_proj.weight", ("shared.down",), "linear", "moe",
         needs="shared_expert_ffn_dim"),
)

RULES: dict[str, tuple[Rule, ...]] = {"llada_moe": LLADA_MOE_RULES, "llada": LLADA_RULES, "llada2_moe": LLADA2_RULES}

# HF tensors that exist in some checkpoints but carry nothing we need: RoPE frequency buffers are
# recomputed from the config. This explicit allow-list is the only thing the loader skips.
IGNORED = (re.compile(r".*\.rotary_emb\.inv_freq"),)


def is_ignored(key: str) -> bool:
  return any(p.fullmatch(key) for p in IGNORED)


# -------------------------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class Piece:
  """A block of one param leaf: `params[path][index]` (index = leading layer/expert indices)."""
  path: tuple[str, ...]
  index: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Entry:
  """One HF tensor and the param pieces it maps to."""
  key: str
  hf_shape: tuple[int, ...]
  transform: Transform
  pieces: tuple[Piece, ...]
  piece_shapes: tuple[tuple[int, ...], ...]

  def to_jax(self, x: np.ndarray) -> list[np.ndarray]:
    return self.transform.to_jax(x, self.piece_shapes)

  def to_hf(self, pieces: Sequence[np.ndarray]) -> np.ndarray:
    return self.transform.to_hf(pieces)


def _check_supported(cfg: ModelConfig):
  if cfg.family == "llada" and cfg.qk_norm:
    # OLMo's attention_layer_norm normalises over the full q/k width, not per head: no place for it in
    # the param tree, so refuse rather than map it to the per-head q_norm.
    raise CheckpointError("dense LLaDA with attention_layer_norm=true (qk-norm over the full width) is not supported")
  if cfg.family == "llada_moe" and cfg.n_dense_layers:
    raise CheckpointError("LLaDA-MoE with dense layers is not supported (every LLaDA-MoE layer is MoE)")


def _layer_kind(cfg: ModelConfig, i: int) -> tuple[str, int]:
  return ("dense_layers", i) if i < cfg.n_dense_layers else ("moe_layers", i - cfg.n_dense_layers)


def _rule_applies(rule: Rule, cfg: ModelConfig, layout: str) -> bool:
  if rule.layout != "any" and rule.layout != layout:
    return False
  return rule.needs is None or bool(getattr(cfg, rule.needs))


def plan(cfg: ModelConfig, layout: str = "per_expert") -> list[Entry]:
  """Every HF tensor of a checkpoint with this config and layout, in canonical order, with its pieces.

  Raises CheckpointError if the entries would not cover each param element exactly once (a bug in the
  table, or a config the table cannot express).
  """
  if layout not in LAYOUTS:
    raise CheckpointError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
  _check_supported(cfg)
  tree = abstract_params(cfg)
  leaves = {tuple(p.key for p in path): x.shape for path, x in _flatten(tree)}
  rules = [r for r in RULES[cfg.family] if _rule_applies(r, cfg, layout)]
  entries: list[Entry] = []

  def add(rule: Rule, key: str, group: tuple[str, ...], index: tuple[int, ...]):
    pieces = tuple(Piece(group + tuple(t.split(".")), index) for t in rule.targets)
    shapes = []
    for p in pieces:
      if p.path not in leaves:
        raise CheckpointError(f"internal: rule {rule.hf!r} targets {'.'.join(p.path)}, which this config has no param for")
      shapes.append(tuple(leaves[p.path][len(index):]))
    tf = TRANSFORMS[rule.transform]
    entries.append(Entry(key, tf.hf_shape(shapes), tf, pieces, tuple(shapes)))

  for r in rules:
    if r.layers == "global":
      add(r, r.hf, (), ())
  for i in range(cfg.n_layers):
    group, li = _layer_kind(cfg, i)
    kind = "dense" if group == "dense_layers" else "moe"
    for r in rules:
      if r.layers == "global" or (r.layers != "all" and r.layers != kind):
        continue
      if "{e}" in r.hf:
        for e in range(cfg.n_experts):
          add(r, r.hf.format(i=i, e=e), (group,), (li, e))
      else:
        add(r, r.hf.format(i=i), (group,), (li,))
  _check_coverage(entries, leaves)
  return entries


def _flatten(tree):
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def _check_coverage(entries: Sequence[Entry], leaves: dict[tuple[str, ...], tuple[int, ...]]):
  """Each element of each leaf written by exactly one entry; counted per leading-index block."""
  count: dict[tuple[str, ...], np.ndarray] = {}
  depth: dict[tuple[str, ...], int] = {}
  for en in entries:
    for p in en.pieces:
      d = depth.setdefault(p.path, len(p.index))
      if d != len(p.index):
        raise CheckpointError(f"internal: param {'.'.join(p.path)} is filled at mixed granularities")
      c = count.setdefault(p.path, np.zeros(leaves[p.path][:d], np.int32))
      c[p.index] += 1
  for path in leaves:
    name = ".".join(path)
    if path not in count:
      raise CheckpointError(f"param {name} {leaves[path]} is not covered by any HF tensor")
    c = count[path]
    if (c != 1).any():
      bad = tuple(int(v) for v in np.argwhere(c != 1)[0])
      raise CheckpointError(f"param {name} block {bad} is covered {int(c[bad])} times (expected once)")


def expected_hf_keys(cfg: ModelConfig, layout: str = "per_expert") -> dict[str, tuple[int, ...]]:
  """{HF key: shape} of a complete checkpoint for this config and layout, in canonical order."""
  return {e.key: e.hf_shape for e in plan(cfg, layout)}


def is_fp32_key(key: str) -> bool:
  """HF tensors that stay fp32 whatever the weight dtype (the router bias buffer, params.FP32_PARAMS)."""
  return any(key.endswith(f".{name}") for name in FP32_PARAMS)


def hf_dtype(key: str, dtype) -> np.dtype:
  """The dtype an HF tensor is written in: `dtype`, except the fp32 router bias buffer."""
  return np.dtype(np.float32) if is_fp32_key(key) else np.dtype(dtype)


# ------------------------------------------------------------------------------------------ diagnostics
def match(family: str, key: str) -> tuple[Rule, int | None, int | None] | None:
  """The table row an HF key matches, with its layer and expert index; None if no row does."""
  for r in RULES[family]:
    m = r.regex.fullmatch(key)
    if m:
      g = m.groupdict()
      return r, (int(g["i"]) if "i" in g else None), (int(g["e"]) if "e" in g else None)
  return None


def explain_unmapped(cfg: ModelConfig, layout: str, key: str) -> str:
  """Why a key present in a checkpoint is not in the plan, for the error message."""
  m = match(cfg.family, key)
  if m is None:
    return f"no {cfg.family} rule maps it"
  rule, i, e = m
  if i is not None and i >= cfg.n_layers:
    return f"layer {i} is out of range (config has {cfg.n_layers} layers)"
  if e is not None and e >= cfg.n_experts:
    return f"expert {e} is out of range (config has {cfg.n_experts} experts)"
  if rule.layout != "any" and rule.layout != layout:
    return f"it belongs to the {rule.layout} layout but the checkpoint is {layout} (mixed layouts)"
  if rule.needs and not getattr(cfg, rule.needs):
    return f"the config has {rule.needs} off"
  if i is not None and rule.layers in ("dense", "moe"):
    kind = "dense" if i < cfg.n_dense_layers else "moe"
    if kind != rule.layers:
      return f"layer {i} is a {kind} layer in the config but this is a {rule.layers}-layer tensor"
  return "no rule maps it"


def check_counts(cfg: ModelConfig, layout: str, keys: Sequence[str], where: str) -> None:
  """The config's layer and (per-expert layout) expert counts against the indices the weight keys hold, when
  its plan (about n_layers x n_experts entries) would be far larger than the keys: a config.json claiming
  10^9 layers took 3 GB and a minute before any error. A smaller mismatch is left to the plan, whose error
  names the first missing tensor."""
  per_layer = 3 * cfg.n_experts + 16 if layout == "per_expert" else 16
  if cfg.n_layers * per_layer <= 10 * len(keys) + 10_000:
    return
  layers, experts = -1, -1
  for k in keys:
    m = match(cfg.family, k)
    if m is not None:
      layers = max(layers, m[1] if m[1] is not None else -1)
      experts = max(experts, m[2] if m[2] is not None else -1)
  if cfg.n_layers > layers + 1:
    raise CheckpointError(f"{where}: config.json has {cfg.n_layers} layers but the weights hold "
                          f"{layers + 1} (layers 0..{layers})")
  if layout == "per_expert" and cfg.n_moe_layers and cfg.n_experts > experts + 1:
    raise CheckpointError(f"{where}: config.json has {cfg.n_experts} experts but the weights hold {experts + 1}")


def detect_layout(family: str, keys: Sequence[str]) -> str:
  """'fused' if the experts come as stacked mlp.w1/w2, else 'per_expert'; mixing both is an error."""
  fused = next((k for k in keys if k.endswith(".mlp.w1") or k.endswith(".mlp.w2")), None)
  per = next((k for k in keys if ".mlp.experts." in k), None)
  if fused and per:
    raise CheckpointError(f"mixed expert layouts: {fused!r} is fused but {per!r} is per-expert")
  return "fused" if fused else "per_expert"


def group_by_leaf(entries: Sequence[Entry]) -> dict[tuple[str, ...], list[tuple[Entry, int]]]:
  """leaf path -> [(entry, which piece of the entry)] in plan order."""
  out: dict[tuple[str, ...], list[tuple[Entry, int]]] = {}
  for en in entries:
    for j, p in enumerate(en.pieces):
      out.setdefault(p.path, []).append((en, j))
  return out
