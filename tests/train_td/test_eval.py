"""train_td eval: the JSON output format on a tiny random model."""
import json

import jax

from train_td import __main__ as td_main
from train_td import export as export_lib
from train_td import trainer


def test_eval_json_on_tiny_random_model(tmp_path, capsys):
  tc = trainer.TrainConfig(d_model=32, n_layers=2, n_heads=2, n_experts=4, n_experts_per_tok=2,
                           expert_ffn_dim=32)
  params, _ = trainer.init_state(tc)
  out = tmp_path / "tiny"
  export_lib.export_params(params, tc.model_config(), out)
  rc = td_main.main(["eval", "--model", str(out), "--task", "arithmetic", "--n", "4", "--seed", "0",
                     "--batch", "4", "--json"])
  assert rc == 0
  lines = capsys.readouterr().out.strip().splitlines()
  res = json.loads(lines[-1])
  assert res["n"] == 4 and res["task"] == "arithmetic"
  assert 0.0 <= res["accuracy"] <= 1.0
  for k in ("mean_tpf", "mean_nfe", "tpf", "tps"):
    assert isinstance(res[k], float) and res[k] >= 0.0
  assert res["mean_nfe"] >= 1.0
  # Knobs not given come from the model's generation_config.json; flags override them.
  assert res["generation_config"]["gen_length"] == export_lib.DEFAULT_GENERATION["gen_length"]
  assert res["generation_config"]["cache"] == "dual"
  rc = td_main.main(["eval", "--model", str(out), "--task", "program", "--n", "4", "--batch", "4",
                     "--cache", "none", "--json"])
  res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert res["generation_config"]["cache"] == "none" and res["task"] == "program" and res["n"] == 4
