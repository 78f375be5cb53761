"""train_td.memory: the TD step compiles for a mesh with abstract weights and reports per-device memory
that follows the options (here on this machine's CPU devices; the H200 numbers need the CUDA plugin)."""
import jax
import pytest

from dinfer_jax import make_mesh
from dinfer_jax.model import params as params_lib
from train_td import memory, trainer

TINY = dict(d_model=64, n_layers=4, n_heads=4, n_experts=4, n_experts_per_tok=2, expert_ffn_dim=64)


def _peak(mesh, **opts):
  cfg = trainer.TrainConfig(**TINY).model_config()
  return memory.memory(memory.compile_td_step(cfg, mesh, batch=8, seq=256, target="cpu", **opts))


@pytest.mark.slow  # over 20 s on 2 cores: -m slow
def test_memory_follows_the_options_and_the_mesh():
  one = make_mesh(devices=jax.devices()[:1])
  plain = _peak(one, **memory.OPTIONS["plain"])
  low = _peak(one, **memory.OPTIONS["remat+bf16"])
  cfg = trainer.TrainConfig(**TINY).model_config()
  state_gib = params_lib.count_params(cfg)["total"] * 4 * 3 / 2**30  # fp32 weights + two Adam moments
  # the master weights and moments stay fp32 whatever the compute dtype; the step's state is donated
  assert low["arg_gib"] == pytest.approx(plain["arg_gib"]) and plain["arg_gib"] >= state_gib
  assert plain["out_not_aliased_gib"] < 0.01 and plain["temp_gib"] > 0
  # (what remat saves is a GPU-compile number, train_td/README.md: XLA:CPU's buffer assignment differs)
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 fake CPU devices (tests/conftest.py)")
  split = _peak(make_mesh(tensor=2, expert=4), **memory.OPTIONS["plain"])
  # weights and moments split over tensor x expert: each device holds a fraction of the state
  assert split["arg_gib"] < 0.6 * plain["arg_gib"]

