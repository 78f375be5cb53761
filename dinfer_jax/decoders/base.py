"""What a decoder is: a static, hashable rule plus a struct of traced knobs, registered once by name.

A decoder class holds only what shapes its compiled program (the credit decoder's vocab size, the fixed
schedule's steps per block); the values a user sweeps (thresholds, credit weights) are its `Knobs`, a
flax.struct of scalars that the engine passes to `step` as traced arrays, so one compiled program serves
every value. The knob fields are named as GenerationConfig's fields, so a config gives them directly.

Adding a decoder is one class with `@register("name")` (and a GenerationConfig field for a knob no decoder
had before): the engine, the Python-stepped loop, continuous batching, the CLI and the server all find it
through `get` / `from_config`.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

_REGISTRY: dict[str, type["Decoder"]] = {}


@flax.struct.dataclass
class Knobs:
  """The traced values every decoder takes. threshold: the confidence threshold (iteration smoothing relaxes
  it per step and row; a decoder without one ignores it)."""
  threshold: Any = 0.9


class Decoder:
  """Base of the decoders. Subclasses are frozen dataclasses (static jit arguments), registered by name.

  Class attributes:
    name: the registry name (GenerationConfig.decoder), set by `register`.
    Knobs: the flax.struct of traced knobs, a subclass of base.Knobs; its fields are GenerationConfig fields.
    static_fields: GenerationConfig fields that change the compiled program (static dataclass fields of the
      decoder built by from_config); a config that sets one for another decoder is refused.
    settles: the decoder says when a block is done (block_active), not "no mask left"; a block then ends
      on a step that wrote nothing, so its last forward saw its final tokens.
    edits: commits may rewrite decoded positions of the block (never the prompt or earlier blocks).
    PRESETS: named sets of knob values (GenerationConfig fields), e.g. LLaDA2.1's S and Q modes.
  """

  name: ClassVar[str] = ""
  Knobs: ClassVar[type] = Knobs
  static_fields: ClassVar[tuple[str, ...]] = ()
  settles: ClassVar[bool] = False
  edits: ClassVar[bool] = False
  PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

  # ------------------------------------------------------------------ construction from a config
  @classmethod
  def from_config(cls, gcfg: Any, *, vocab_size: int) -> "Decoder":
    """The static decoder for a GenerationConfig (knob values are not part of it)."""
    del gcfg, vocab_size
    return cls()

  @classmethod
  def knob_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls.Knobs))

  @classmethod
  def check_config(cls, gcfg: Any) -> None:
    """Validates the config's values of this decoder's knobs and static fields; ValueError names the field
    as GenerationConfig.<field>."""
    cls.check_knobs({k: getattr(gcfg, k) for k in cls.knob_names()}, "GenerationConfig")

  @classmethod
  def check_knobs(cls, values: Mapping[str, Any], owner: str) -> None:
    """Validates host knob values; `owner` prefixes the field in the error. Subclasses add their rules."""
    check_real(values, "threshold", owner, 0.0, 1.0, lo_open=True)

  @classmethod
  def knobs(cls, **values) -> Any:
    """The knobs from keyword values (defaults for the rest), validated: for calling `step` directly."""
    unknown = sorted(set(values) - set(cls.knob_names()))
    if unknown:
      raise ValueError(f"{cls.__name__}: unknown knob(s) {', '.join(unknown)}; valid knobs: "
                       f"{', '.join(cls.knob_names())}")
    kn = cls.Knobs(**values)
    cls.check_knobs({k: getattr(kn, k) for k in cls.knob_names()}, f"{cls.__name__}.Knobs")
    return kn

  @classmethod
  def knobs_of(cls, gcfg: Any) -> Any:
    """The config's knob values as the engine passes them: fp32 (or int32) numpy scalars."""
    def scalar(v):
      return np.int32(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else np.float32(v)
    return cls.Knobs(**{k: scalar(getattr(gcfg, k)) for k in cls.knob_names()})

  # ------------------------------------------------------------------ the rule
  def max_steps(self, block_len: int) -> int:
    """The most steps a block can take (the loop's backstop is twice this, plus the cache's extra forwards)."""
    return block_len

  def block_active(self, state: PyTree, tokens: jax.Array, maskable: jax.Array, *, mask_id: int) -> jax.Array:
    """Only for decoders that settle: [B] rows whose block is not done yet (tokens [B, L], maskable [B, L]
    as in step)."""
    raise NotImplementedError(f"{type(self).__name__} does not settle its blocks (settles=False)")

  def init_state(self, tokens: jax.Array, maskable: jax.Array) -> PyTree:
    """Fresh per-block state. tokens [B, L] int32 (the block's canvas slice); maskable [B, L] bool (positions
    of the block, False for padding past the canvas). Default: none."""
    del tokens, maskable
    return ()

  def step(self, state: PyTree, logits: jax.Array, tokens: jax.Array, maskable: jax.Array, knobs: Any, *,
           mask_id: int, temperature: float | jax.Array = 0.0,
           rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array, PyTree]:
    """One decoding step.

    Args:
      state: from init_state (or the previous step).
      logits: [B, L, V] block logits (cast to fp32).
      tokens: [B, L] int32 block canvas.
      maskable: [B, L] bool block membership.
      knobs: this class's Knobs (Python floats, or traced fp32 scalars; threshold may be per step).
      mask_id: static MASK id.
      temperature: 0 is argmax; a static float > 0 or a traced scalar samples.
      rng: PRNG key (or [B] keys), read only when sampling.

    Returns:
      (new_tokens [B, L] int32, committed [B, L] bool, new_state); committed positions were masked.
    """
    raise NotImplementedError


def register(name: str):
  """Class decorator: registers a Decoder subclass under `name` (GenerationConfig.decoder)."""
  def wrap(cls: type[Decoder]) -> type[Decoder]:
    if name in _REGISTRY and _REGISTRY[name] is not cls:
      raise ValueError(f"decoder name {name!r} is already registered by {_REGISTRY[name].__name__}")
    cls.name = name
    _REGISTRY[name] = cls
    return cls
  return wrap


def names() -> tuple[str, ...]:
  """The registered decoder names, in registration order."""
  return tuple(_REGISTRY)


def get(name: str) -> type[Decoder]:
  cls = _REGISTRY.get(name)
  if cls is None:
    raise ValueError(f"decoder name {name!r} is unknown; valid names: {', '.join(_REGISTRY)}")
  return cls


def from_config(gcfg: Any, *, vocab_size: int) -> Decoder:
  """The one decoder factory: the static decoder a GenerationConfig names."""
  return get(gcfg.decoder).from_config(gcfg, vocab_size=vocab_size)


def static_fields() -> dict[str, str]:
  """Every registered decoder's static GenerationConfig fields -> the decoder that reads it."""
  return {f: n for n, cls in _REGISTRY.items() for f in cls.static_fields}


# ----------------------------------------------------------------------------- validation helpers

def check_real(values: Mapping[str, Any], field: str, owner: str, lo: float | None = None,
               hi: float | None = None, *, lo_open: bool = False) -> None:
  """A finite real knob in [lo, hi] ((lo, hi] with lo_open); ValueError names owner.field. A traced scalar
  passes: its host value was checked where it was set."""
  value = values[field]
  if isinstance(value, jax.core.Tracer):
    return
  scalar = isinstance(value, numbers.Real) or (getattr(value, "ndim", None) == 0
                                               and np.issubdtype(np.dtype(value.dtype), np.number))
  if isinstance(value, (bool, np.bool_)) or not scalar or not math.isfinite(float(value)):
    raise ValueError(f"{owner}.{field}={value!r}: must be a finite real number")
  v = float(value)
  if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
    interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
    raise ValueError(f"{owner}.{field}={value!r}: must be in {interval}")


def check_positive_int(owner: object, field: str) -> None:
  """Validates a positive int dataclass field of a decoder; ValueError names the field."""
  value = getattr(owner, field)
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
    raise ValueError(f"{type(owner).__name__}.{field}: must be a positive int (got {value!r})")
  object.__setattr__(owner, field, int(value))


def as_f32(x: Any) -> jax.Array:
  return jnp.asarray(x, jnp.float32)
