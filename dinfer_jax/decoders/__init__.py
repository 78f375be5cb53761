"""Parallel decoders: pure, jittable per-block token selection rules (dInfer's and the baselines), each a
static class plus traced knobs, registered by name (decoders.base)."""
from __future__ import annotations

import importlib
import pkgutil

from dinfer_jax.decoders.base import Decoder, Knobs, from_config, get, names, register
from dinfer_jax.decoders.common import Proposal, propose
# Importing a decoder's module registers it; the registry keeps this order (the CLI lists it).
from dinfer_jax.decoders.threshold import ThresholdDecoder
from dinfer_jax.decoders.hierarchy import HierarchyDecoder, HierarchyKnobs
from dinfer_jax.decoders.credit import CreditDecoder, CreditKnobs, CreditState
from dinfer_jax.decoders.baselines import FastDLLMDecoder, FixedStepsDecoder, FixedStepsState
from dinfer_jax.decoders.joint_threshold import JointThresholdDecoder, JointThresholdKnobs, JointThresholdState
from dinfer_jax.decoders.entropy import EntropyDecoder, EntropyKnobs

# Every module of this package is imported, so that a new decoder's module with its @register is all it takes.
for _m in pkgutil.iter_modules(__path__):
  importlib.import_module(f"{__name__}.{_m.name}")

__all__ = [
    "CreditDecoder", "CreditKnobs", "CreditState", "Decoder", "EntropyDecoder", "EntropyKnobs", "FastDLLMDecoder",
    "FixedStepsDecoder", "FixedStepsState", "HierarchyDecoder", "HierarchyKnobs", "JointThresholdDecoder",
    "JointThresholdKnobs", "JointThresholdState", "Knobs", "Proposal", "ThresholdDecoder", "from_config", "get",
    "names", "propose", "register",
]
