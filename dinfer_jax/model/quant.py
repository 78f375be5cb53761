"""Weight-only 8-bit inference: FP8 (e4m3) or int8 weights with per-output-channel or 128x128-block scales.

The quantised leaves are google's qwix `QArray`s (qvalue int8/float8_e4m3fn + fp32 scale with one entry per
tile), so a quantised param tree is still a plain pytree at every jit boundary. Which leaves: the attention
projections (q, k, v, o), the dense FFN, the routed experts and the shared expert. The embedding, router,
norms and LM head stay in the model dtype (the LM head only unless QuantConfig.lm_head): the router picks experts (an 8-bit router moves the top-k), the
LM head's logits are the decoder's confidences, and the embedding is a gather of a few rows.

Scales (absmax calibration, symmetric, no zero point):
- "channel": one scale per output channel of every layer (and expert);
- "block": one per block of `block` x `block` weights in the HF [out, in] matrix, the layout of published
  FP8 checkpoints (DeepSeek-style `weight_scale_inv`, LLaDA2.x FP8). Our kernels are [in, out] with the
  head axes split out (q [D, N, H], o [N, H, D]); a block of 128 flattened (N, H) entries is a tile of
  (128 / H, H) for H <= 128 and (1, 128) for H >= 128, so a block checkpoint maps tile for tile.

Activations stay in the model dtype and accumulation in fp32, unless the weights carry an activation policy
(QuantConfig.act_min_tokens, "+a8"): then a forward of at least that many tokens quantises each product's
input per token on the fly (quantize_rows) and multiplies two 8-bit operands (W8A8: int32 / fp32
accumulation, both scales on the result; the 8-bit tensor cores run twice the bf16 rate). The policy is a
static field of the weight (ActQArray), so the forward takes no extra argument. "+embed" stores the
embedding table in 8 bits too (a scale per row). qwix provides the format (QArray), the
quantisation and the dequantisation; tokamax's Pallas-Triton grouped GEMM takes the QArray itself and scales
in-kernel. The XLA GEMMs (einsum below) multiply by the convert()ed 8-bit values and apply per-channel scales
outside the product, because qwix's own weight-only einsum dequantises in front of the dot and XLA writes
that bf16 weight to HBM before the GEMM reads it (measured on the roofline bench's H200 compile); the
roofline bench reports the bytes of any such copy (`dequantized_copy_bytes`).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import qwix

SCHEMES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
SCALES = ("channel", "block")

# name -> (contracting axes, output axes), of the per-layer kernel (no layer axis); the axes before them
# (the expert axis) get their own scales. Leaves not named here are never quantised.
_KERNEL_AXES = {
    "q": ((0,), (1, 2)), "k": ((0,), (1, 2)), "v": ((0,), (1, 2)), "o": ((0, 1), (2,)),
    "gate": ((0,), (1,)), "up": ((0,), (1,)), "down": ((0,), (1,)),
}
_PARENTS = {"q": None, "k": None, "v": None, "o": None, "gate": ("mlp", "experts", "shared"),
            "up": ("mlp", "experts", "shared"), "down": ("mlp", "experts", "shared")}


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """weights: "int8" or "fp8" (e4m3); scales: "channel" or "block" (block x block tiles of [out, in]);
  lm_head: the LM head too (per vocabulary entry), at the price of 8-bit rounding in the logits the decoder
  thresholds. embed: the input embedding table too (one scale per row, in the table's own dtype, so the
  model's activation dtype stays the table's): its rows are looked up and dequantised, and iteration
  smoothing's probabilities x table product reads it in 8 bits. act_min_tokens: see DEFAULT_ACT_MIN_TOKENS
  (None: weight-only). act_group: 0, one activation scale per token; else one per token and run of act_group
  contracted elements ("+a8g": 1 x ACT_GROUP, as DeepSeek-V3's FP8 recipe), so one outlier channel coarsens
  the rounding of its own group only, not of the token's whole row."""
  weights: str = "int8"
  scales: str = "channel"
  block: int = 128
  lm_head: bool = False
  act_min_tokens: int | None = None
  embed: bool = False
  act_group: int = 0

  def __post_init__(self):
    if self.weights not in SCHEMES:
      raise ValueError(f"QuantConfig: weights must be one of {sorted(SCHEMES)}, got {self.weights!r}")
    if self.scales not in SCALES:
      raise ValueError(f"QuantConfig: scales must be one of {SCALES}, got {self.scales!r}")
    if self.block < 1:
      raise ValueError(f"QuantConfig: block must be >= 1, got {self.block}")
    if self.act_min_tokens is not None:
      if self.act_min_tokens < 0:
        raise ValueError(f"QuantConfig: act_min_tokens must be >= 0, got {self.act_min_tokens}")
      if self.scales != "channel":
        raise ValueError("QuantConfig: 8-bit activations (act_min_tokens) need per-channel weight scales: block "
                         "scales vary along the contracted axis, so the product cannot run in 8 bits")
    if self.act_group and (self.act_group < 0 or self.act_min_tokens is None):
      raise ValueError(f"QuantConfig: act_group={self.act_group} needs 8-bit activations (act_min_tokens) and "
                       "a positive group")
    if self.embed and self.scales != "channel":
      raise ValueError("QuantConfig: an 8-bit embedding table (embed) takes one scale per row: per-channel "
                       "scales only")

  @property
  def runtime_only(self) -> bool:
    """Options chosen when a model is loaded, not stored in a converted checkpoint."""
    return self.act_min_tokens is not None or self.embed

  @property
  def qtype(self):
    return SCHEMES[self.weights]

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def parse(cls, spec: "QuantConfig | str | dict | None") -> "QuantConfig | None":
    """None/"none"/"bf16" -> None; "int8", "fp8", "fp8-block", "int8-channel", then options: "+head" for the
    LM head too ("fp8+head"), "+embed" for the embedding table too, "+a8" for dynamic 8-bit activations in
    forwards of at least DEFAULT_ACT_MIN_TOKENS tokens, "+a8:N" from N tokens ("fp8+head+embed+a8",
    "int8+a8:0"), "+a8g" / "+a8g:N" for the same with one scale per 1 x ACT_GROUP group of a token's
    contracted elements; a dict; a QuantConfig."""
    if spec is None or isinstance(spec, QuantConfig):
      return spec
    if isinstance(spec, dict):
      return cls(**spec)
    s = str(spec).lower()
    if s in ("none", "bf16", "bfloat16", "float32"):
      return None
    s, *opts = s.split("+")
    head, embed, act, group = False, False, None, 0
    for o in opts:
      name, colon, n = o.partition(":")
      if o == "head" and not head:
        head = True
      elif o == "embed" and not embed:
        embed = True
      elif name in ("a8", "a8g") and act is None and (not colon or n.isdigit()):
        act = int(n) if colon else DEFAULT_ACT_MIN_TOKENS
        group = ACT_GROUP if name == "a8g" else 0
      else:
        raise ValueError(f"quantize {spec!r}: unknown option '+{o}'; the options are '+head' (the LM head too), "
                         f"'+embed' (the embedding table too) and '+a8' / '+a8:N' (8-bit activations from N "
                         f"tokens per forward; '+a8g' / '+a8g:N' with a scale per 1 x {ACT_GROUP} group), each once")
    weights, _, scales = s.partition("-")
    return cls(weights=weights, scales=scales or "channel", lm_head=head, act_min_tokens=act, embed=embed,
               act_group=group)


# From this many tokens per forward the activations go 8-bit by default: every refresh (1280 tokens per
# sequence on the 7B-A1B bench), where the GEMMs are compute-bound and 8-bit tensor cores run twice as fast
# (the bench's realistic batch-1 refresh at fp8: 5.84 -> 4.79 ms; batch 8: 39.0 -> 21.2 ms). Not the cached windows:
# at batch 1 (96 tokens, ~12 rows per expert) a forward reads weights far more than it computes, and even at
# batch 8 (768 tokens) the quantisation's own kernels and bytes cost more than the faster products save
# (3.97 -> 4.26 ms by the same model).
DEFAULT_ACT_MIN_TOKENS = 1024
# "+a8g": a token's contracted elements in runs of this many, one activation scale each (1 x 128 groups, the
# fine-grained activation scaling of DeepSeek-V3's FP8 training recipe and of the FP8 checkpoints' kernels).
ACT_GROUP = 128


def format_tag(spec: str) -> str:
  """A weight format as a name suffix ("fp8-block" -> "fp8_block", "int8+head" -> "int8_head", "fp8+a8:0" ->
  "fp8_a8_0")."""
  return spec.replace("-", "_").replace("+", "_").replace(":", "_")


def is_qarray(x) -> bool:
  # qwix is imported only once something is quantised: it costs ~1 s of start-up otherwise.
  qwix = sys.modules.get("qwix")
  return qwix is not None and isinstance(x, qwix.QArray)


def is_quantized(params) -> bool:
  return any(is_qarray(x) for x in jax.tree_util.tree_leaves(params, is_leaf=is_qarray))


def leaf_axes(path: tuple[str, ...], ndim: int, qc: "QuantConfig | None" = None
              ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  """(contracting, output) axes of a quantisable leaf of `ndim` dims (stacked or per-layer, with or
  without the expert axis), or None for a leaf that stays unquantised (the LM head unless qc.lm_head)."""
  name = path[-1]
  if name == "lm_head" and len(path) == 1:
    return ((0,), (1,)) if (qc is not None and qc.lm_head and ndim == 2) else None
  if name == "embed" and len(path) == 1:  # [V, D]: a row per token, the smoothing product contracts V
    return ((1,), (0,)) if (qc is not None and qc.embed and ndim == 2) else None
  if name not in _KERNEL_AXES:
    return None
  parents = _PARENTS[name]
  if parents is not None and (len(path) < 2 or path[-2] not in parents):
    return None
  ca, oa = _KERNEL_AXES[name]
  kernel_ndim = len(ca) + len(oa)
  lead = ndim - kernel_ndim
  if lead < 0:
    return None
  return tuple(a + lead for a in ca), tuple(a + lead for a in oa)


def _group_tiles(sizes: tuple[int, ...], block: int, what: str) -> tuple[int, ...]:
  """Per-axis tiles that cut the row-major flattening of axes `sizes` into runs of `block` (a group
  smaller than one block is one tile)."""
  total = int(np.prod(sizes))
  if total <= block:
    return tuple(sizes)
  if total % block:
    raise ValueError(f"{what}: {total} is not a multiple of the {block}-wide scale blocks")
  tiles, left = [], block
  for s in reversed(sizes):
    if left >= s:
      if left % s:
        raise ValueError(f"{what}: axis of {s} does not tile into {block}-wide scale blocks")
      tiles.append(s)
      left //= s
    else:
      if s % left:
        raise ValueError(f"{what}: axis of {s} does not tile into {block}-wide scale blocks")
      tiles.append(left)
      left = 1
  return tuple(reversed(tiles))


def tile_shape(path: tuple[str, ...], shape: tuple[int, ...], qc: QuantConfig) -> tuple[int, ...]:
  """The tile each scale covers, per axis of the leaf: 1 on the layer and expert axes; "channel": 1 on the
  output axes and the whole contracting axes, except the experts' down projection, scaled per input channel
  (see channel_axes); "block": block-wide runs of the flattened contracting and output axes."""
  axes = leaf_axes(path, len(shape), qc)
  if axes is None:
    raise ValueError(f"{'/'.join(path)}: not a quantisable weight")
  ca, oa = axes
  if qc.scales == "channel":
    keep = set(channel_axes(path, len(shape), qc))
    return tuple(1 if a in keep else s for a, s in enumerate(shape))
  tiles = [1] * len(shape)
  what = f"{'/'.join(path)} {tuple(shape)}"
  for group in (ca, oa):
    for a, t in zip(group, _group_tiles(tuple(shape[a] for a in group), qc.block, what)):
      tiles[a] = t
  return tuple(tiles)


def channel_axes(path: tuple[str, ...], ndim: int, qc: "QuantConfig | None" = None) -> tuple[int, ...]:
  """Axes with one scale per index under the "channel" scheme: the layer and expert axes and the output
  axes. The experts' down projection is the exception, scaled per (expert, input channel): the dense
  all-experts path contracts experts and F in one GEMM ("ETF,EFD->TD"), where a per-(expert, output) scale
  cannot be applied after the sum, while a per-(expert, F) one folds into the activations before it."""
  ca, oa = leaf_axes(path, ndim, qc)
  lead = tuple(range(min(ca + oa)))
  if path[-1] == "down" and len(path) >= 2 and path[-2] == "experts":
    return lead + ca
  return lead + oa


def scale_shape(path: tuple[str, ...], shape: tuple[int, ...], qc: QuantConfig) -> tuple[int, ...]:
  return tuple(s // t for s, t in zip(shape, tile_shape(path, shape, qc)))


def quantize_leaf(path: tuple[str, ...], w, qc: QuantConfig):
  """One weight -> QArray (qvalue in qc.qtype, fp32 scales), absmax per tile."""
  tiles = tile_shape(path, w.shape, qc)
  tiled = {a: t for a, t in enumerate(tiles) if t != 1}
  channel = [a for a, t in enumerate(tiles) if t == 1]
  return qwix.quantize(jnp.asarray(w, jnp.float32), qc.qtype, channelwise_axes=channel, tiled_axes=tiled,
                       scale_dtype=jnp.float32)


def with_parts(w, qvalue, scale):
  """A QArray node holding other leaves in its places (e.g. the shardings of its values and scales)."""
  return dataclasses.replace(w, qvalue=qvalue, scale=scale)


def make_qarray(qvalue, scale, act_min_tokens: int | None = None, act_group: int = 0):
  """A QArray from stored parts (a checkpoint's qvalue and fp32 scale); with act_min_tokens, one whose products
  quantise their activations too, per token or per act_group run of a token's contracted elements (see
  _act_class)."""
  if act_min_tokens is None:
    return qwix.QArray(qvalue=qvalue, scale=scale)
  return _act_class()(qvalue=qvalue, scale=scale, act_min_tokens=act_min_tokens, act_group=act_group)


_ACT_CLASS = []


def _act_class():
  """qwix's QArray with a static field: the products of a weight of this class quantise their activations per
  token (dynamic, absmax) to the weight's 8-bit type when the forward has at least act_min_tokens tokens. The
  policy travels with the weights (as qwix's qtype does) and is part of the tree's structure: the forward
  needs no extra argument, and a tree with another policy is another compile."""
  if not _ACT_CLASS:

    @flax.struct.dataclass
    class ActQArray(qwix.QArray):
      act_min_tokens: int = flax.struct.field(pytree_node=False, default=0)
      act_group: int = flax.struct.field(pytree_node=False, default=0)

    _ACT_CLASS.append(ActQArray)
  return _ACT_CLASS[0]


def act_min_tokens(w) -> int | None:
  """The weight's activation policy: None (weight-only), else the fewest tokens that quantise activations."""
  return getattr(w, "act_min_tokens", None) if is_qarray(w) else None


def act_group(w) -> int:
  """The weight's activation scale groups: 0, one scale per token; else elements per scale."""
  return getattr(w, "act_group", 0) if is_qarray(w) else 0


def run_length(w, K: int) -> int:
  """The elements per activation scale of a product contracting K with weight w: 0 for one scale per token,
  else its act_group, or K when K is shorter (one run)."""
  group = act_group(w)
  return min(group, K) if group else 0


def act8(w, tokens: int) -> bool:
  """Whether a product with weight w over `tokens` rows runs on 8-bit activations (its policy says so)."""
  n = act_min_tokens(w)
  return n is not None and tokens >= n


def with_act(w, n: int | None, group: int = 0):
  """A QArray with activation policy n (None: weight-only) and scale groups `group`."""
  return make_qarray(w.qvalue, w.scale, n, group) if (act_min_tokens(w), act_group(w)) != (n, group) else w


# Activations' symmetric bounds. Not qwix.quantize's: its int8 bound is 127.5, which puts every row's absmax
# element on a rounding boundary (+-127.5), so for activations quantised on the fly fp32 noise decides it
# (-127 or -128): two exact implementations of the same MoE layer (the grouped kernels and the loop
# reference) then differed in 5-19% of their outputs, by up to 15% of the quantisation error itself. With
# 127 the absmax element lands on +-127 exactly. (Weights, quantised once, stay qwix's.)
ACT_QMAX = {"int8": 127.0, "fp8": 448.0}


def quantize_rows(x: jax.Array, qtype, axes: tuple[int, ...], group: int = 0) -> tuple[jax.Array, jax.Array]:
  """Dynamic symmetric quantisation of activations: one fp32 scale per index of the axes not in `axes` (per
  token), absmax over `axes`. Returns (values in qtype, scale with `axes` kept as 1s); x ~ values * scale.
  group > 0: `axes` is x's last axis alone, cut into runs of `group` elements with a scale each: the scale is
  [..., K / group] and x ~ values * repeat(scale, group) along the last axis."""
  if group:
    if axes != (x.ndim - 1,) or x.shape[-1] % group:
      raise ValueError(f"quantize_rows: groups of {group} cut the last axis alone (axes {axes} of {x.shape})")
    v, s = quantize_rows(x.reshape(*x.shape[:-1], x.shape[-1] // group, group), qtype, (x.ndim,))
    return v.reshape(x.shape), s[..., 0]
  xf = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(xf), axis=axes, keepdims=True)
  qmax = ACT_QMAX["int8" if jnp.dtype(qtype) == jnp.int8 else "fp8"]
  # An all-zero row gets the smallest normal scale (its values are 0 either way) instead of 0 / 0: a max, not
  # a select, so XLA can compute the scale inside the kernel that converts.
  scale = jnp.maximum(amax / qmax, jnp.finfo(jnp.float32).tiny)
  v = jnp.clip(xf / scale, -qmax, qmax)
  if jnp.dtype(qtype) == jnp.int8:
    v = jnp.round(v)
  return v.astype(qtype), scale


def accumulator(qtype):
  """The product's accumulator for 8-bit operands: int32 for int8 (exact), fp32 for FP8."""
  return jnp.int32 if jnp.dtype(qtype) == jnp.int8 else jnp.float32


def join_columns(ws: list) -> Any:
  """Kernels [D, ...] (all plain or all QArrays) as one [D, X] kernel, their output axes flattened and laid
  side by side. A QArray's scales flatten and join the same way: its tiles span whole contracted blocks by
  contiguous runs of the flattened output (a channel, or a 128-wide block), so the joined scales tile the
  joined values."""
  if not any(is_qarray(w) for w in ws):
    return jnp.concatenate([w.reshape(w.shape[0], -1) for w in ws], axis=1)
  if not all(is_qarray(w) for w in ws):
    raise ValueError("join_columns: kernels are either all quantised or all plain")
  qv = jnp.concatenate([w.qvalue.reshape(w.shape[0], -1) for w in ws], axis=1)
  sc = jnp.concatenate([w.scale.reshape(w.scale.shape[0], -1) for w in ws], axis=1)
  return make_qarray(qv, sc, act_min_tokens(ws[0]), act_group(ws[0]))


def _keys(path) -> tuple[str, ...]:
  return tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path)


def quantize_params(params: dict[str, Any], qc: QuantConfig | str) -> dict[str, Any]:
  """The param tree with every quantisable weight replaced by a QArray (the rest unchanged). A weight that is
  already a QArray stays as it is when it has qc's format (value dtype and scale grid), and is requantised
  from its fp32 dequantised values otherwise (one leaf at a time: e.g. FP8 block scales -> per channel)."""
  qc = QuantConfig.parse(qc)
  if qc is None:
    return params

  def one(path, w):
    keys = tuple(k for k in _keys(path) if isinstance(k, str))
    if leaf_axes(keys, np.ndim(w), qc) is None:
      return w
    if is_qarray(w):
      if w.qvalue.dtype == qc.qtype and tuple(w.scale.shape) == scale_shape(keys, w.shape, qc):
        return with_act(w, qc.act_min_tokens, qc.act_group)
      dt, w = w.dtype, dequantize(w, jnp.float32)
    else:
      dt = w.dtype
    q = quantize_leaf(keys, w, qc)
    if keys == ("embed",):  # the table's dtype is the model's activation dtype (QArray.dtype is the scale's)
      q = with_parts(q, q.qvalue, q.scale.astype(dt))
    return with_act(q, qc.act_min_tokens, qc.act_group)

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_qarray)


def dequantize(w, dtype=None):
  """A QArray back to a dense array (in the scale's dtype or `dtype`); other arrays unchanged."""
  if not is_qarray(w):
    return w
  return qwix.dequantize(w if dtype is None else w.astype(dtype))


def dequantize_params(params, dtype=None):
  """The plain reference: every QArray dequantised (what the quantised forward must reproduce)."""
  return jax.tree_util.tree_map(lambda w: dequantize(w, dtype), params, is_leaf=is_qarray)


def _expand(spec: str, ndim: int) -> str:
  """One operand's subscripts with '...' spelled out as the leading letters the spec does not use."""
  if "..." not in spec:
    return spec
  free = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in spec]
  n = ndim - (len(spec) - 3)
  return spec.replace("...", "".join(free[:n]))


def einsum(spec: str, x: jax.Array, w, *, preferred_element_type=None) -> jax.Array:
  """x (activations) times a kernel w, plain or quantised; the kernel is used in x's dtype.

  A per-channel QArray multiplies by its convert()ed 8-bit values and applies the scales outside the
  product: to the output when they index output axes, to x when they index contracted ones (the experts'
  down projection). XLA fuses a bare convert into its GEMM's operand load, so the weights are read from
  HBM in 8 bits; qwix's own weight-only einsum dequantises (convert, then multiply by the scales) in front
  of the dot, and XLA writes that bf16 weight to HBM first (the roofline bench's H200 compile: 17.4 MB
  moved for a 2048 x 1024 int8 GEMM at 96 tokens, 9.0 MB this way). Block scales, which vary along the
  contracted axes, are dequantised in front of the product as qwix does (correct, but on GPU the dequantised
  weight is materialised)."""
  dt = x.dtype
  out_dt = preferred_element_type or dt
  if not is_qarray(w):
    return jnp.einsum(spec, x, w.astype(dt), preferred_element_type=preferred_element_type)
  ins, out = spec.split("->")
  xs, ws = ins.split(",")
  # The output's '...' takes x's leading letters.
  xs_full = _expand(xs, x.ndim)
  ws_full = _expand(ws, w.ndim)
  out_full = out.replace("...", xs_full[:len(xs_full) - (len(xs) - 3)]) if "..." in out else out
  full = f"{xs_full},{ws_full}->{out_full}"
  scaled = [c for c, n, size in zip(ws_full, w.scale.shape, w.shape) if n != 1]
  if any(n not in (1, size) for n, size in zip(w.scale.shape, w.shape)):
    return _dequantized_einsum(full, x, w, preferred_element_type)
  s = w.scale.astype(jnp.float32).reshape([n for n in w.scale.shape if n != 1])
  if act8(w, x.size // _contracted_size(xs_full, out_full, x.shape)):
    return _act8_einsum(full, x, w, s, scaled, out_dt)
  q = w.qvalue.astype(dt)
  if all(c in out_full for c in scaled):
    y = jnp.einsum(full, x, q, preferred_element_type=jnp.float32)
    y = y * jax.lax.broadcast_in_dim(s, y.shape, [out_full.index(c) for c in scaled])
    return y.astype(out_dt)
  if all(c in xs_full for c in scaled):
    xf = x.astype(jnp.float32) * jax.lax.broadcast_in_dim(s, x.shape, [xs_full.index(c) for c in scaled])
    return jnp.einsum(full, xf.astype(dt), q, preferred_element_type=preferred_element_type).astype(out_dt)
  return _dequantized_einsum(full, x, w, preferred_element_type)


def take_rows(table, ids: jax.Array) -> jax.Array:
  """Rows of an embedding table [V, D] (plain or an 8-bit QArray with one scale per row) -> [..., D] in the
  table's dtype (a QArray's: its scale's)."""
  if not is_qarray(table):
    return jnp.take(table, ids, axis=0)
  rows = jnp.take(table.qvalue, ids, axis=0).astype(jnp.float32) * jnp.take(table.scale, ids, axis=0).astype(jnp.float32)
  return rows.astype(table.dtype)


def _contracted_size(xs: str, out: str, shape) -> int:
  return int(np.prod([n for c, n in zip(xs, shape) if c not in out]))


def _act8_einsum(full: str, x: jax.Array, w, s: jax.Array, scaled: list[str], out_dt) -> jax.Array:
  """W8A8: x quantised per token (absmax over its contracted axes, after the weight's per-input-channel
  scales where it has them) to the weight's 8-bit type, the product of the two 8-bit operands accumulated in
  int32 / fp32 (8-bit tensor cores on GPU), then both scales applied to the fp32 result."""
  ins, out = full.split("->")
  xs, ws = ins.split(",")
  xf = x.astype(jnp.float32)
  if not all(c in out for c in scaled):  # scales on contracted axes: they go to x before its quantisation
    xf = xf * jax.lax.broadcast_in_dim(s, x.shape, [xs.index(c) for c in scaled])
  axes = tuple(i for i, c in enumerate(xs) if c not in out)
  group = run_length(w, x.shape[axes[-1]])
  if group:  # a contracted axis shorter than a group is one run (per head for o's 128-wide heads)
    y = _act8_grouped(xs, ws, out, xf, w, axes, group)
  else:
    xq, sx = quantize_rows(xf, w.qvalue.dtype, axes)
    y = jnp.einsum(full, xq, w.qvalue, preferred_element_type=accumulator(w.qvalue.dtype)).astype(jnp.float32)
    kept = [c for c in xs if c in out]
    y = y * jax.lax.broadcast_in_dim(sx.reshape([n for i, n in enumerate(x.shape) if i not in axes]), y.shape,
                                     [out.index(c) for c in kept])
  if all(c in out for c in scaled):
    y = y * jax.lax.broadcast_in_dim(s, y.shape, [out.index(c) for c in scaled])
  return y.astype(out_dt)


def _act8_grouped(xs: str, ws: str, out: str, xf: jax.Array, w, axes: tuple[int, ...], group: int) -> jax.Array:
  """The 8-bit product with a scale per `group` run of the last contracted axis of x (and per index of its
  other contracted axes): the runs' partial products are kept apart in the output, each scaled by its run's
  scale, then summed (an 8-bit GEMM that promotes its accumulator per K group does the same in-kernel)."""
  c = xs[axes[-1]]
  g = next(ch for ch in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if ch not in xs + ws + out)
  K = xf.shape[axes[-1]]
  if K % group:
    raise ValueError(f"8-bit activations in groups of {group}: contracted axis of {K} is not a multiple")
  split = lambda a, i: a.reshape(a.shape[:i] + (K // group, group) + a.shape[i + 1:])  # noqa: E731
  xg = split(xf, axes[-1])
  qv = split(w.qvalue, ws.index(c))
  xs2, ws2 = xs.replace(c, g + c), ws.replace(c, g + c)
  others = [ch for ch in xs if ch not in out and ch != c]
  out2 = out + "".join(others) + g
  xq, sx = quantize_rows(xg, w.qvalue.dtype, (xs2.index(c),))  # absmax over each run
  y = jnp.einsum(f"{xs2},{ws2}->{out2}", xq, qv, preferred_element_type=accumulator(w.qvalue.dtype))
  y = y.astype(jnp.float32)
  sx = sx.reshape([n for i, n in enumerate(xg.shape) if i != xs2.index(c)])
  y = y * jax.lax.broadcast_in_dim(sx, y.shape, [out2.index(ch) for ch in xs2 if ch != c])
  return y.sum(axis=tuple(range(len(out), len(out2))))


def _dequantized_einsum(spec: str, x: jax.Array, w, preferred_element_type) -> jax.Array:
  """qwix's weight-only path for a bf16/fp32 x (dequantise in x's dtype, then the plain einsum): what block
  scales need, since they vary along the contracted axes."""
  return jnp.einsum(spec, x, dequantize(w, x.dtype), preferred_element_type=preferred_element_type)


def ragged_dot(x: jax.Array, w, sizes: jax.Array, eight_bit_operand: bool = False) -> jax.Array:
  """jax.lax.ragged_dot for a plain or quantised [G, K, N] kernel (the non-tokamax path): x [M, K] rows sorted
  by group, sizes [G] -> [M, N] in x's dtype.

  A per-channel QArray multiplies by its 8-bit values and applies the scales outside the product, as einsum
  does: each row's group's scales to the output ([G, 1, N]: gate, up) or to the row before it ([G, K, 1]: the
  experts' down projection). With eight_bit_operand (the TPU's kernels: moe) the 8-bit values go into the
  product as they are, elsewhere as a bare convert to x's dtype: XLA TPU's ragged dot reads s8 weights next
  to bf16 rows, where qwix's dequantise-first path wrote a bf16 copy of every expert's weights per call. A v5e's
  batch-1 refresh (7B-A1B, 10240 routed rows per layer; bench.realistic's kernel charges): 79.1 ms with
  qwix's path (12.9 GB of dequantised copies), 31.5 ms this way (bf16 weights: 53). Block scales, which vary
  along K, still dequantise first."""
  if not is_qarray(w):
    return jax.lax.ragged_dot(x, w.astype(x.dtype), sizes)
  G, K, N = w.shape
  if w.scale.shape not in ((G, 1, N), (G, K, 1)):
    return qwix.ragged_dot(x, w.astype(x.dtype), sizes)
  rows = _group_scales(sizes, w.scale.reshape(G, -1), x.shape[0])
  q = w.qvalue if eight_bit_operand else w.qvalue.astype(x.dtype)
  if w.scale.shape[1] == K:
    return jax.lax.ragged_dot((x.astype(jnp.float32) * rows).astype(x.dtype), q, sizes, preferred_element_type=x.dtype)
  # The product leaves in x's dtype (accumulated in fp32 inside the kernel), so the scaling fuses into its
  # consumer (the SwiGLU) instead of a pass over an fp32 [M, N] result; a bf16 rounding before a scale is the
  # same relative error as after it.
  y = jax.lax.ragged_dot(x, q, sizes, preferred_element_type=x.dtype)
  return (y.astype(jnp.float32) * rows).astype(x.dtype)


def _group_scales(sizes: jax.Array, scale: jax.Array, M: int) -> jax.Array:
  """Each row's group's scales, [M, C], for rows sorted by group (rows past the last group: none).

  A one-hot [M, G] by [G, C] product rather than a gather: XLA TPU writes a gather of [M, C] fp32 rows to HBM
  (3 x 335 MB per layer at 81920 rows), while the product fuses into the multiply that consumes it. HIGHEST
  precision keeps the fp32 scales exact (a 0/1 matrix times them)."""
  ends = jnp.cumsum(sizes)
  group = jnp.sum(jnp.arange(M, dtype=ends.dtype)[:, None] >= ends[None, :], axis=1)
  onehot = (group[:, None] == jnp.arange(scale.shape[0], dtype=group.dtype)[None, :]).astype(jnp.float32)
  return jnp.dot(onehot, scale.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def weight_bytes(params) -> dict[str, int]:
  """Bytes of the quantised values, of their scales, and of everything else."""
  out = {"qvalue": 0, "scale": 0, "other": 0}
  for w in jax.tree_util.tree_leaves(params, is_leaf=is_qarray):
    if is_qarray(w):
      out["qvalue"] += int(np.prod(w.qvalue.shape)) * jnp.dtype(w.qvalue.dtype).itemsize
      out["scale"] += int(np.prod(w.scale.shape)) * jnp.dtype(w.scale.dtype).itemsize
    else:
      out["other"] += int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize
  return out


# ------------------------------------------------------------------------------- checkpoint storage form
# A converted checkpoint stores each QArray as {"qvalue": ..., "scale": ...}: plain dict nodes, so orbax, the
# tree checks and partial restores see ordinary arrays (checkpoint/converted.py).
STORED_PARTS = ("qvalue", "scale")


def to_storage(params):
  """QArray leaves -> {"qvalue", "scale"} dicts."""
  return jax.tree_util.tree_map(lambda w: {"qvalue": w.qvalue, "scale": w.scale} if is_qarray(w) else w,
                                params, is_leaf=is_qarray)


def from_storage(tree):
  """{"qvalue", "scale"} dicts -> QArrays (the inverse of to_storage)."""
  if isinstance(tree, dict):
    if set(tree) == set(STORED_PARTS):
      return make_qarray(tree["qvalue"], tree["scale"])
    return {k: from_storage(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return type(tree)(from_storage(v) for v in tree)
  return tree


def abstract_storage(abstract_params, qc: QuantConfig):
  """The storage form of abstract params quantised with qc: ShapeDtypeStructs (qvalue in qc.qtype, fp32
  scales), without computing anything."""
  return to_storage(jax.eval_shape(lambda p: quantize_params(p, qc), abstract_params))
