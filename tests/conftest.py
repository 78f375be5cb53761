"""Test setup: 8 fake CPU devices for sharding tests, full-precision matmuls for numerics."""
import os
import shutil
import tempfile

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI's compilation cache (--compile-cache, default under $XDG_CACHE_HOME) goes to one directory per
# test run, shared by the xdist workers and the CLI subprocesses, never the user's own cache.
# (The controller imports this first; its workers inherit the variable.)
_RUN_CACHE = os.environ.setdefault("DINFER_JAX_TEST_CACHE",
                                   os.path.join(tempfile.gettempdir(), f"dinfer-jax-tests-{os.getpid()}"))
os.environ["XDG_CACHE_HOME"] = _RUN_CACHE

import jax  # noqa: E402

# Numerics tests compare against fp32 references; the CPU default is already fp32, but be explicit.
jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model():
  """The embedded default model (dinfer_jax.load("default")), loaded once per session."""
  import dinfer_jax
  return dinfer_jax.load("default")


@pytest.fixture(scope="session")
def default_gcfg(default_model):
  """The generation config `dinfer-jax generate` uses for the embedded model (its generation_config.json)."""
  from dinfer_jax import cli, cli_common
  return cli_common.generation_config(cli.build_parser().parse_args(["generate", "x"]), default_model.path)


def pytest_sessionfinish(session, exitstatus):
  if not hasattr(session.config, "workerinput"):  # the controller, after every worker is done
    shutil.rmtree(_RUN_CACHE, ignore_errors=True)
