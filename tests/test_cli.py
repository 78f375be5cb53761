"""dinfer-jax generate: prints the answer, --show-steps shows every forward, bad knobs exit 2 in one line."""
import pathlib
import re

import pytest

from dinfer_jax import cli, cli_common

MODEL = str(pathlib.Path(__file__).parent / "golden" / "decode" / "A")
KNOBS = ["--gen-length", "16", "--block-length", "8", "--mask-id", "509", "--eos-id", "506"]


def test_generate_show_steps(capsys):
  assert cli.main(["generate", "--model", MODEL, "--show-steps", "--cache", "dual", *KNOBS, "1,2,3,4,5"]) == 0
  out = capsys.readouterr().out.strip().splitlines()
  steps = [l for l in out if re.match(r"^\s*\d+ \+\d+ ", l)]
  assert steps and [int(l.split()[0]) for l in steps] == list(range(1, len(steps) + 1))
  # Every generated position is committed at exactly one step: the final line lists them all.
  assert "_" not in steps[-1]
  assert "[" in steps[0]  # newly committed tokens are bracketed
  answer = out[-1].split()
  assert len(answer) == 16 and all(t.isdigit() for t in answer)


def test_every_generation_knob_is_a_flag():
  import dataclasses
  from dinfer_jax.engine.config import GenerationConfig
  ap = cli.build_parser()
  sub = ap._subparsers._group_actions[0].choices["generate"]
  flags = {o for a in sub._actions for o in a.option_strings}
  for f in dataclasses.fields(GenerationConfig):
    assert "--" + f.name.replace("_", "-") in flags


@pytest.mark.parametrize("argv,msg", [
    (["--threshold", "1.5"], "threshold"),
    (["--decoder", "greedy"], "decoder"),
    (["--prefix-look", "4"], "dual"),
])
def test_bad_knobs_exit_2_with_one_line(argv, msg, capsys):
  assert cli.main(["generate", "--model", MODEL, *KNOBS, *argv, "1,2,3"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error:") and msg in err and len(err.splitlines()) == 1


def test_text_prompt_without_tokenizer_is_a_clear_error(capsys):
  assert cli.main(["generate", "--model", MODEL, *KNOBS, "hello there"]) == 2  # a usage error, as the others
  assert "no tokenizer" in capsys.readouterr().err


def test_model_generation_defaults_sit_between_dataclass_and_flags(tmp_path):
  (tmp_path / "generation_config.json").write_text('{"gen_length": 24, "block_length": 8, "cache": "dual", '
                                                   '"temperature_unknown_key": 1}')
  ap = cli.build_parser()
  args = ap.parse_args(["generate", "x"])
  cfg = cli_common.generation_config(args, str(tmp_path))
  assert (cfg.gen_length, cfg.block_length, cfg.cache, cfg.threshold) == (24, 8, "dual", 0.9)
  args = ap.parse_args(["generate", "--gen-length", "40", "--cache", "none", "x"])
  cfg = cli_common.generation_config(args, str(tmp_path))
  assert (cfg.gen_length, cfg.block_length, cfg.cache) == (40, 8, "none")


def test_generate_quantize_flag(capsys):
  """--quantize loads 8-bit weights; on the default model the answer is the bf16 one (BENCHMARKS: accuracy
  within 0.5 points at int8 and fp8)."""
  import json
  assert cli.main(["generate", "--quantize", "fp8", "--json", "What is 348+279?"]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["answer"] == "627"
  with pytest.raises(SystemExit):
    cli.main(["generate", "--quantize", "int4", "What is 1+2?"])
  assert "--quantize: 'int4': choose from int8, fp8" in capsys.readouterr().err
  with pytest.raises(SystemExit):  # the options need per-channel scales
    cli.main(["generate", "--quantize", "fp8-block+a8", "What is 1+2?"])
  assert "per-channel" in capsys.readouterr().err
