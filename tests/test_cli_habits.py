"""What users reach for first: --version, choices and the model's defaults in the help, prompts from a file
or stdin (lines or JSONL, chats with a system prompt), batching, --json, --max-new-tokens, --stop, a
warning for characters the tokenizer does not know, quiet transformers, convert/train subcommands."""
import io
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

import dinfer_jax
from dinfer_jax import cli, cli_common

GOLDEN = pathlib.Path(__file__).parent / "golden"
QS = ["What is 348+279?", "f(0..5)=2,5,8,11,14,17", "12 x 13", "905-417", "61*7"]


@pytest.fixture(scope="module")
def model(default_model):
  return default_model


@pytest.fixture(scope="module")
def gcfg(default_gcfg):
  return default_gcfg


def _alone(model, gcfg, msgs_or_text, system=None):
  ids = cli_common.encode_prompts(model, [msgs_or_text], system=system)[0]
  # Stripped, as the CLI prints it (plain and --json): the model pads answers to a column (" 627").
  return model.tokenizer.decode(dinfer_jax.generate(model, [ids], gcfg).tokens[0], skip_special_tokens=True).strip()


def _json_lines(out):
  return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def test_version(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["--version"])
  assert e.value.code == 0 and capsys.readouterr().out.strip() == f"dinfer-jax {dinfer_jax.__version__}"


def test_help_lists_choices_and_the_models_defaults(capsys):
  with pytest.raises(SystemExit):
    cli.main(["generate", "--help"])
  out = " ".join(capsys.readouterr().out.split())
  assert "--decoder {threshold,hierarchy,credit,fixed_steps,fastdllm,joint_threshold,entropy}" in out and "--cache {none,prefix,dual}" in out
  assert "default 8 (the model's generation_config.json; dataclass 128)" in out  # the embedded model's
  with pytest.raises(SystemExit):
    cli.main(["generate", "--model", str(GOLDEN / "decode" / "A"), "--help"])
  out = " ".join(capsys.readouterr().out.split())
  assert "--gen-length GEN_LENGTH default 128 " in out  # that model ships no generation_config.json


def test_prompts_from_a_file_stdin_and_jsonl_batched(model, gcfg, tmp_path, capsys, monkeypatch):
  lines = tmp_path / "p.txt"
  lines.write_text("\n".join(QS) + "\n\n")
  assert cli.main(["generate", "-f", str(lines), "--json", "--batch-size", "2"]) == 0
  out = capsys.readouterr()
  assert "5/5" in out.err  # a progress bar: more than one batch
  rows = _json_lines(out.out)
  assert [r["prompt"] for r in rows] == QS
  assert [r["answer"] for r in rows] == [_alone(model, gcfg, q) for q in QS]
  assert all(r["nfe"] > 0 and r["tpf"] == pytest.approx(r["tokens"] / r["nfe"]) for r in rows)
  # JSONL: a chat, a {"prompt"} line and a JSON string; read from stdin.
  chat = [{"role": "user", "content": "348+279"}]
  jl = "\n".join([json.dumps({"messages": chat}), json.dumps({"prompt": "61*7"}), json.dumps("905-417")])
  monkeypatch.setattr(sys, "stdin", io.StringIO(jl))
  assert cli.main(["generate", "-", "--json", "--batch-size", "2", "--no-progress"]) == 0
  rows = _json_lines(capsys.readouterr().out)
  assert [r["answer"] for r in rows] == [_alone(model, gcfg, chat), _alone(model, gcfg, "61*7"),
                                         _alone(model, gcfg, "905-417")]


def test_chats_reach_the_model_or_are_refused(model, gcfg, tmp_path, capsys):
  """The embedded model's chat template has no place for a system message, and it answers single questions:
  a system prompt was dropped without a word, and a two-turn chat answered ''. Both are refused now, naming
  why, as an empty message is; a template that renders the system message passes it to the model."""
  assert cli.main(["generate", "--system", "You add.", "348+279"]) == 2
  assert "no place for a system message" in capsys.readouterr().err
  two = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2"}]
  empty = [{"role": "user", "content": "  "}]
  for chat, why in ((two, "3 turns, but the model at .* answers single questions"), (empty, "message 0 .* is empty")):
    with pytest.raises(ValueError, match=why):
      cli_common.encode_prompts(model, [chat])
  d = tmp_path / "m"
  shutil.copytree(model.path, d)
  (d / "chat_template.jinja").write_text(
      "{%- for m in messages -%}{{- '<|user|>' + m['content'] -}}{%- endfor -%}{{- '<|assistant|>' -}}")
  with_system = dinfer_jax.load(d)
  a, b = cli_common.encode_prompts(with_system, ["348+279"], system="sort"), cli_common.encode_prompts(
      with_system, ["348+279"])
  assert len(a[0]) > len(b[0]) and a[0][-len(b[0]):] == b[0]  # the system turn, then the same question


def test_max_new_tokens_and_stop(model, gcfg, capsys):
  full = _alone(model, gcfg, QS[1])
  assert full == "x*3+2"
  assert cli.main(["generate", "--json", "--max-new-tokens", "2", QS[1]]) == 0
  r = _json_lines(capsys.readouterr().out)[0]
  assert r["tokens"] == 2 and r["answer"] == "x*"
  assert cli.main(["generate", "--stop", "+", "--stop", "3", QS[1]]) == 0
  assert capsys.readouterr().out.strip() == "x*"


def test_bad_prompt_sources_are_one_line_errors(tmp_path, capsys, monkeypatch):
  assert cli.main(["generate", "-f", str(tmp_path / "missing.txt")]) == 2
  assert "missing.txt" in capsys.readouterr().err
  monkeypatch.setattr(sys, "stdin", io.StringIO('{"prompt": "1+1"}\n{"messages": 3}\n'))
  assert cli.main(["generate", "-"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: <stdin>:2:") and len(err.splitlines()) == 1
  assert cli.main(["generate"]) == 2
  assert "no prompts" in capsys.readouterr().err


def test_unknown_characters_are_a_warning(capsys):
  assert cli.main(["generate", "3€+4"]) == 0
  err = capsys.readouterr().err
  assert "warning: prompt 0: '€' not in the tokenizer's vocabulary" in err


@pytest.mark.slow  # compiles/indexes more than the default suite can afford
def test_transformers_noise_is_silenced():
  r = subprocess.run([sys.executable, "-m", "dinfer_jax.cli", "generate", "What is 348+279?"], capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0 and r.stdout.strip() == "627"
  assert "PyTorch was not found" not in r.stderr and "to instantiate a model of type" not in r.stderr


def test_convert_and_train_subcommands(capsys):
  assert cli.main(["convert", "inspect", str(GOLDEN / "forward" / "tiny_llada_moe")]) == 0
  assert "tensors" in capsys.readouterr().out
  assert cli.main(["train", "eval", "--task", "arithmetic", "--n", "4", "--json"]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n"] == 4
  with pytest.raises(SystemExit) as e:
    cli.main(["train", "--help"])
  assert e.value.code == 0 and "{train,export,eval,collect,distill}" in capsys.readouterr().out


def test_json_answer_is_the_plain_answer_and_keeps_the_steps(model, gcfg, capsys):
  q = "What is 348+279?"
  raw = model.tokenizer.decode(dinfer_jax.generate(model, cli_common.encode_prompts(model, [q]), gcfg).tokens[0],
                               skip_special_tokens=True)
  assert raw != raw.strip()  # the model pads its answers: what this test is about
  assert cli.main(["generate", q]) == 0
  plain = capsys.readouterr().out.strip()
  assert cli.main(["generate", "--json", q]) == 0
  row = _json_lines(capsys.readouterr().out)[0]
  assert row["answer"] == plain == raw.strip() and "steps" not in row
  assert cli.main(["generate", "--json", "--show-steps", q]) == 0
  row = _json_lines(capsys.readouterr().out)[0]
  assert row["answer"] == plain and len(row["steps"]) == row["nfe"]
  # The steps account for every committed token exactly once, with its text.
  got = {p: (t, x) for s in row["steps"] for p, t, x in zip(s["positions"], s["tokens"], s["text"])}
  assert sum(len(s["positions"]) for s in row["steps"]) == len(got)
  ids = [got[p][0] for p in sorted(got)]
  assert model.tokenizer.decode(ids, skip_special_tokens=True).strip() == plain
  assert all(model.tokenizer.decode([t], skip_special_tokens=False) == x for t, x in got.values())
  assert [s["step"] for s in row["steps"]] == list(range(1, row["nfe"] + 1))


def test_model_before_the_command(capsys):
  assert cli.main(["--model", "default-td", "generate", "--json", "What is 12 x 13?"]) == 0
  before = _json_lines(capsys.readouterr().out)[0]
  assert cli.main(["generate", "--model", "default-td", "--json", "What is 12 x 13?"]) == 0
  assert _json_lines(capsys.readouterr().out)[0] == before
  assert cli.main(["--model=default-td", "train", "eval", "--task", "arithmetic", "--n", "4", "--json"]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["model"].endswith("default-td")


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_every_command_help_shows_the_models_defaults(command, capsys):
  with pytest.raises(SystemExit):
    cli.main([command, "--help"])
  out = " ".join(capsys.readouterr().out.split())
  assert "default 8 (the model's generation_config.json; dataclass 128)" in out, out


def test_no_module_imports_the_cli_back():
  """The entry point imports the shared pieces (cli_common); nothing in the packages imports dinfer_jax.cli."""
  import ast
  root = pathlib.Path(__file__).resolve().parents[1]
  offenders = []
  for pkg in ("dinfer_jax", "train_td", "convert"):
    for f in (root / pkg).rglob("*.py"):
      if f == root / "dinfer_jax" / "cli.py":
        continue
      for node in ast.walk(ast.parse(f.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module
                 else [])
        offenders += [f"{f.relative_to(root)}: {n}" for n in names
                      if n == "dinfer_jax.cli" or n.startswith("dinfer_jax.cli.")]
  assert offenders == []
  assert not (root / "convert" / "measure_memory.py").exists()  # convert/ is the entry point only


def test_prompts_outside_the_models_training_are_flagged(capsys):
  assert cli.main(["generate", "--json", "61 x 7", "12 x 13", "What is 5-9?", "Hello, who are you?"]) == 0
  out = capsys.readouterr()
  rows = _json_lines(out.out)
  assert [r["trained_task"] for r in rows] == ["arithmetic", None, None, None]
  assert all(r["answer"] for r in rows)  # answered all the same
  warned = [l for l in out.err.splitlines() if l.startswith("warning: prompt")]
  assert warned == [f"warning: prompt {i} is outside what the model was trained on (arithmetic, program, add, split): "
                    "its answer is likely wrong" for i in (1, 2, 3)]
  assert cli.main(["generate", "What is 348+279?"]) == 0
  assert "outside what the model" not in capsys.readouterr().err
