"""The shipped default model (dinfer_jax/assets/default): loads with a tokenizer, answers through the CLI,
and keeps its measured held-out accuracy."""
import json

import pytest

import dinfer_jax
from dinfer_jax import api
from dinfer_jax import cli
from train_td import curve
from train_td import evaluate
from train_td import export as export_lib

pytestmark = pytest.mark.skipif(not (api.DEFAULT_MODEL_DIR / "config.json").exists(),
                                reason="the default model is not installed")

# Measured on the shipped weights (default_v14, 2026-12-06; seed 0, threshold 0.9, dual cache, the model's
# generation_config.json): 192/200 held-out arithmetic problems, 38/50 program problems (the first 50 draws
# hold more of the small families, so fewer than on the full set), 97/100 long additions.
# The tests allow a margin below that for other CPUs' float rounding.
ARITHMETIC_ACC_200 = 0.96
PROGRAM_ACC_50 = 0.76
ADD_ACC_100 = 0.97
# default_v14's last fine-tune mix (train_td/retrain_default.sh): its export wrote the long-addition prompt
# rule and the trained tasks.
SHIPPED_MIX = (("arithmetic", 0.3), ("program", 0.5), ("add", 0.05), ("split", 0.15))


@pytest.fixture(scope="module")
def model():
  return dinfer_jax.load()


def test_default_loads_with_tokenizer(model):
  assert model.tokenizer is not None
  assert model.config.family == "llada_moe" and model.config.qk_norm
  assert (model.config.mask_token_id, model.config.eos_token_id) == (2, 1)
  hf = json.loads((api.DEFAULT_MODEL_DIR / "config.json").read_text())
  assert hf["model_type"] == "llada" and hf["architectures"] == ["LLaDAMoEModelLM"]
  gen = json.loads((api.DEFAULT_MODEL_DIR / "generation_config.json").read_text())
  from train_td import trainer
  assert gen == export_lib.run_generation_config(trainer.TrainConfig(mix=SHIPPED_MIX))


def _gcfg(task: str = "arithmetic"):
  # the settings a user gets: the model's generation_config.json and its prompt rule for the task
  import argparse
  return evaluate.task_generation_config(argparse.Namespace(), str(api.DEFAULT_MODEL_DIR), task)


def test_cli_generate_answers(capsys):
  # README's main command, plus a program-synthesis prompt and a question in words.
  long_sum = "What is 123456789012345678 + 987654321098765432?"
  assert cli.main(["generate", "What is 348+279?", "f(0..5)=2,5,8,11,14,17", "what is 12 times 3", long_sum]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines == ["### What is 348+279?", "627", "### f(0..5)=2,5,8,11,14,17", "x*3+2",
                   "### what is 12 times 3", "36", f"### {long_sum}", str(123456789012345678 + 987654321098765432)]


def test_heldout_arithmetic_accuracy(model):
  res = evaluate.evaluate(model, "arithmetic", 200, _gcfg(), seed=0, batch=100, warmup=False)
  assert res["accuracy"] >= ARITHMETIC_ACC_200 - 0.03, res["accuracy"]
  assert res["mean_nfe"] >= 1.0


def test_heldout_program_accuracy(model):
  # Every answer runs in the sandbox (one process each), hence 50 problems.
  res = evaluate.evaluate(model, "program", 50, _gcfg("program"), seed=0, batch=50, warmup=False)
  assert res["accuracy"] >= PROGRAM_ACC_50 - 0.06, res["accuracy"]


def test_heldout_long_addition_accuracy(model):
  gcfg = _gcfg("add")
  assert (gcfg.gen_length, gcfg.block_length) == (32, 8)  # its prompt rule: four blocks of 8
  res = evaluate.evaluate(model, "add", 100, gcfg, seed=0, batch=100, warmup=False)
  assert res["accuracy"] >= ADD_ACC_100 - 0.04, res["accuracy"]
  assert res["mean_tpf"] > 2.0  # 25 characters in far fewer forwards than one per token


@pytest.mark.slow  # over 20 s on 2 cores: -m slow
def test_curve_writes_table_and_plot(tmp_path):
  md, png = tmp_path / "curve.md", tmp_path / "curve.png"
  assert curve.main(["--task", "arithmetic,program", "--n", "4", "--thresholds", "0.9", "--decoders", "threshold",
                     "--md", str(md), "--png", str(png)]) == 0
  lines = [l for l in md.read_text().splitlines() if l.startswith("| arithmetic") or l.startswith("| program")]
  # one row per task x smoothing setting, each with an accuracy in [0, 1] and a positive TPF
  assert len(lines) == 2 * len(curve.SMOOTHING)
  for l in lines:
    cells = [c.strip() for c in l.strip("|").split("|")]
    assert 0.0 <= float(cells[5]) <= 1.0 and float(cells[6]) > 0  # after task, model, decoder, smoothing, threshold
  assert png.stat().st_size > 1000


def test_shipped_td_variant_loads_and_keeps_the_base_accuracy(model):
  # dinfer_jax/assets/default-td (train_td/README.md): the base's settings, within 2 points of its accuracy
  td = dinfer_jax.load("default-td")
  assert td.config == model.config and td.path != model.path
  res = evaluate.evaluate(td, "add", 100, _gcfg("add"), seed=0, batch=100, warmup=False)
  assert res["accuracy"] >= ADD_ACC_100 - 0.04, res["accuracy"]
