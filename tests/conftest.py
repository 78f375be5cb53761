"""Test setup: 8 fake CPU devices for sharding tests, full-precision matmuls for numerics."""
import os

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Numerics tests compare against fp32 references; the CPU default is already fp32, but be explicit.
jax.config.update("jax_default_matmul_precision", "highest")
