"""train_td/retrain_default.sh, the one command that retrains the embedded default model: every stage it
runs is a valid `python -m train_td` command line, each fine-tune starts from the stage before it, the
export takes the last one, and the last stage's mix is the one the shipped model's generation_config.json
was written from. Running it takes over an hour, so only the command lines are checked here."""
import dataclasses
import json
import pathlib
import shlex
import subprocess

from dinfer_jax import api
from train_td import __main__ as cli
from train_td import export as export_lib
from train_td import trainer

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "train_td" / "retrain_default.sh"


def _commands(work: str, out: str) -> list[list[str]]:
  # Continuation lines joined, comments dropped; the script's variables replaced as bash would.
  text = SCRIPT.read_text().replace("\\\n", " ")
  cmds = []
  for line in text.splitlines():
    line = line.strip()
    if line.startswith('"$PY" -m train_td '):
      line = line.replace("$WORK", work).replace("$OUT", out)
      cmds.append(shlex.split(line)[3:])
  return cmds


def test_every_stage_parses_and_chains():
  cmds = _commands("/w", "/o")
  parser = cli.build_parser()
  trains = [parser.parse_args(c) for c in cmds if c[0] == "train"]
  export = parser.parse_args(cmds[-1])
  assert [c[0] for c in cmds] == ["train"] * len(trains) + ["export"] and len(trains) == 6
  configs = [dataclasses.replace(trainer.TrainConfig(), **cli.train_config_fields(a)) for a in trains]
  assert configs[0].init_from == ""  # from scratch
  for prev, args, tc in zip(trains, trains[1:], configs[1:]):
    assert tc.init_from == prev.run_dir, (args.run_dir, tc.init_from)
    assert tc.model_config() == configs[0].model_config()  # a fine-tune keeps the architecture
  assert len({a.run_dir for a in trains}) == len(trains)
  assert (export.run_dir, export.out, export.overwrite) == (trains[-1].run_dir, "/o", True)
  # The shipped generation_config.json (trained tasks, the long-sum prompt rule) is the last stage's.
  shipped = json.loads((api.DEFAULT_MODEL_DIR / "generation_config.json").read_text())
  assert shipped == export_lib.run_generation_config(configs[-1])


def test_usage_error_without_a_work_dir():
  res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
  assert res.returncode == 2 and "usage: bash train_td/retrain_default.sh WORK_DIR" in res.stderr
