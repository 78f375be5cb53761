"""Fixtures for the engine tests: the tiny golden models (fp32)."""
import pytest

from tests.engine.golden import load_model


@pytest.fixture(scope="session")
def model_a():
  return load_model("A")


@pytest.fixture(scope="session")
def model_dense():
  return load_model("dense")


@pytest.fixture(scope="session")
def model_llada2():
  return load_model("llada2")
