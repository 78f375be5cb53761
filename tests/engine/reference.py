"""The tests' plain Python reference loop: promoted into the package as dinfer_jax.engine.stepped (the
benchmark drives the same loop with jitted forwards); re-exported here under the names the tests use."""
from dinfer_jax.engine.stepped import (REFERENCE, RefResult, ReferenceRunner, _block_causal, _fwd,  # noqa: F401
                                       make_decoder, reference_generate, stepped_generate)
