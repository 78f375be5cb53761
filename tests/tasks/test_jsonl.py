"""TD on any model: JSONL tasks of natural-language problems (math and code verifiers, the model's chat
template), int32 trajectory ids, and the TD run + export on an architecture train_td does not build."""
import dataclasses
import itertools
import json
import pathlib
import re
import shutil

import jax
import numpy as np
import pytest

import dinfer_jax
from dinfer_jax import api
from dinfer_jax.engine.config import GenerationConfig
from train_td import collect as collect_lib
from train_td import evaluate, export as export_lib, prompting, td_data, td_train, trainer
from dinfer_jax import tasks as tasks_lib
from dinfer_jax.model import params as params_lib
from dinfer_jax.tasks import base as tasks_base
from dinfer_jax.tasks import jsonl

pytest.importorskip("pyarrow")
TINY_LLADA = pathlib.Path(__file__).resolve().parents[1] / "golden" / "forward" / "tiny_llada"


@pytest.fixture(autouse=True)
def own_registry(monkeypatch):
  monkeypatch.setattr(tasks_base, "_REGISTRY", dict(tasks_base._REGISTRY))


def _write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


# ------------------------------------------------------------------------------------------ verifiers
@pytest.mark.parametrize("text,ref,ok", [
    ("3 + 4 = 7, so the answer is \\boxed{7}.", "7", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("first 12, then #### 1,234", "1234", True),
    ("She has 5 apples and eats 2: 3 left.", "3", True),
    ("She has 5 apples and eats 2: 3 left, then 4.", "3", False),  # the last number counts
    ("\\boxed{3} ... or maybe 4", "3", True),  # the box wins over later numbers
    ("-0.25", "-1/4", True),
    ("7.0", "7", True),
    ("no number here", "7", False),
    ("", "7", False),
    ("#### yes.", "Yes", False),  # text answers compare exactly (after spaces, $ and a final '.')
    ("#### $yes$.", "yes", True),
    ("\\boxed{x+1}", "x + 1", True),
])
def test_math_verifier(text, ref, ok):
  assert jsonl.math_equal(jsonl.final_answer(text), ref) is ok


def test_extract_code():
  assert jsonl.extract_code("Sure:\n```python\ndef f(x):\n    return x\n```\nDone.") == "def f(x):\n    return x\n"
  assert jsonl.extract_code("def f(x): return x") == "def f(x): return x"
  assert jsonl.extract_code("```\nprint(1)") == "print(1)"  # unterminated fence: to the end


def test_jsonl_errors_name_file_line_and_key(tmp_path):
  bad = [("{\"prompt\": \"q\", \"answer\": \"1\"}\nnot json\n", r"p\.jsonl:2: not valid JSON"),
         ("{\"answer\": \"1\"}\n", r"p\.jsonl:1: 'prompt' must be a non-empty string"),
         ("{\"prompt\": \"q\"}\n", r"p\.jsonl:1: 'answer' must be a non-empty string"),
         ("{\"prompt\": \"q\", \"kind\": \"code\"}\n", r"p\.jsonl:1: a code problem needs 'tests'"),
         ("{\"prompt\": \"q\", \"tests\": []}\n", r"p\.jsonl:1: 'tests' must be a non-empty list"),
         ("{\"prompt\": \"q\", \"answer\": \"1\", \"split\": \"dev\"}\n", r"p\.jsonl:1: 'split' must be"),
         ("{\"prompt\": \"q\", \"answer\": \"1\", \"id\": 3}\n{\"prompt\": \"r\", \"answer\": \"2\", \"id\": \"3\"}\n",
          r"id '3' occurs twice"),
         ("\n\n", r"p\.jsonl: no problems"),
         # Tests that an empty program passes (only builtins, or the setup's names) are no test of it.
         ("{\"prompt\": \"q\", \"tests\": [\"assert max([1, 5, 3]) == 5\"]}\n", r"p\.jsonl:1: no test uses a name"),
         ("{\"prompt\": \"q\", \"tests\": [\"assert gcd(12, 18) == 6\"], \"setup\": \"from math import *\"}\n",
          r"p\.jsonl:1: no test uses a name")]
  for text, msg in bad:
    (tmp_path / "p.jsonl").write_text(text)
    with pytest.raises(ValueError, match=msg):
      jsonl.JsonlTask.from_file(tmp_path / "p.jsonl")
  with pytest.raises(FileNotFoundError, match="task file .*missing.jsonl"):
    tasks_lib.get_task(str(tmp_path / "missing.jsonl"))
  with pytest.raises(ValueError, match="FILE.jsonl"):
    tasks_lib.get_task("no-such-task")


def test_jsonl_split_explicit_or_hashed_the_same_wherever_the_file_is(tmp_path):
  recs = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(200)]
  recs[0]["split"] = "test"
  recs[1]["split"] = "train"
  a = tasks_lib.get_task(_write(tmp_path / "a.jsonl", recs))
  (tmp_path / "sub").mkdir()
  b = tasks_lib.get_task(_write(tmp_path / "sub" / "b.jsonl", recs))
  assert a.name.endswith("a.jsonl") and tasks_lib.get_task(a.name) is a
  test_a = {p.prompt for p in tasks_lib.test_problems(a, 10, seed=0)}
  splits = [a.split_of(a.problem(r)) for r in a.records]
  assert splits == [b.split_of(b.problem(r)) for r in b.records]
  assert splits[0] == "test" and splits[1] == "train"
  n_test = splits.count("test")
  assert 5 <= n_test <= 40  # ~10% hashed, plus the explicit one
  # collect's draw (distinct training problems) reaches every training record, and no test one
  train = list(itertools.islice(tasks_lib.iter_problems(a, "train", 0, unique=True), 200 - n_test))
  assert not test_a & {p.prompt for p in train}
  assert {p.prompt for p in train} == {r.prompt for r, s in zip(a.records, splits) if s == "train"}
  with pytest.raises(RuntimeError, match="found .* distinct"):  # a finite file runs out of problems
    tasks_lib.test_problems(a, n_test + 1, seed=0)


@pytest.mark.skipif(not jsonl.sandbox.available_modes(), reason="no sandbox on this machine")
def test_code_verifier_runs_the_program_in_the_sandbox(tmp_path):
  t = tasks_lib.get_task(_write(tmp_path / "code.jsonl", [{
      "prompt": "Write is_even(n).", "tests": ["assert is_even(2)", "assert not is_even(3)"],
      "setup": "import math", "answer": "def is_even(n): return n % 2 == 0"}]))
  p = t.problem(t.records[0])
  assert t.check(p, "```python\ndef is_even(n):\n    return math.fmod(n, 2) == 0\n```")
  assert t.check(p, p.answer)
  for wrong in ["def is_even(n): return True", "def is_even(n):\n  while True: pass", "syntax error(",
                "import os\nos.system('echo hi')\ndef is_even(n): return n % 2 == 0\nraise SystemExit(1)", "",
                # Programs the sandbox cannot take fail their check instead of ending the run: a lone surrogate
                # (not writable as text) and 4 MiB of code.
                "def is_even(n): return n % 2 == 0  # \ud800", "def is_even(n): return n % 2 == 0\n" + "#" * (4 << 20)]:
    assert not t.check(p, wrong), wrong[:80]


# ---------------------------------------------------------------------- the default model, via chat
def _question(prompt: str) -> str:
  a, op, b = re.fullmatch(r"\s*(\d+)\s*([-+*])\s*(\d+)", prompt).groups()
  return f"What is {a} {op} {b}?"


@pytest.mark.skipif(not (api.DEFAULT_MODEL_DIR / "config.json").exists(), reason="no default model")
def test_jsonl_math_task_through_the_chat_template_matches_the_builtin_task(tmp_path, capsys):
  """The same arithmetic problems, once as the built-in task (internal prompt format) and once as a JSONL
  file of natural-language questions through the model's chat template: same prompt ids, same verdicts."""
  problems = tasks_lib.train_problems("arithmetic", 24, seed=5)
  held = tasks_lib.test_problems("arithmetic", 4, seed=0)
  recs = [{"prompt": _question(p.prompt), "answer": p.answer, "split": "train", "id": i}
          for i, p in enumerate(problems)]
  recs += [{"prompt": _question(p.prompt), "answer": p.answer, "split": "test", "id": f"t{i}"}
           for i, p in enumerate(held)]
  path = _write(tmp_path / "arith.jsonl", recs)
  task = tasks_lib.get_task(path)
  model = dinfer_jax.load("default")
  jprobs = [task.problem(r) for r in task.records[:24]]
  assert prompting.prompt_ids(model, task, jprobs) == prompting.prompt_ids(
      model, tasks_lib.get_task("arithmetic"), problems)
  gcfg = evaluate.task_generation_config(type("A", (), {})(), model.path, path, model.tokenizer, split="train")
  gen_builtin = evaluate.evaluate(model, "arithmetic", 24, gcfg, problems=problems, batch=24, warmup=False)
  gen_jsonl = evaluate.evaluate(model, path, 24, gcfg, problems=jprobs, batch=24, warmup=False)
  assert gen_jsonl["answers"] == gen_builtin["answers"] and gen_jsonl["ok"] == gen_builtin["ok"]
  assert sum(gen_jsonl["ok"]) >= 20  # the shipped model is ~96% right on these

  # collect keeps exactly the verified rows; ids are stored as int32.
  cc = collect_lib.CollectConfig(model="default", task=path, n=24, batch=12,
                                 generation=tuple(sorted(dataclasses.asdict(gcfg).items())))
  got = collect_lib.collect(model, cc, tmp_path / "data", progress=False)
  rec = td_data.read_records(tmp_path / "data")
  assert got["attempted"] == 24 and got["kept"] == len(rec["index"]) >= 20
  by_prompt = dict(zip((p.prompt for p in jprobs), gen_jsonl["ok"]))
  assert all(by_prompt[p] for p in rec["prompt"])
  import pyarrow.parquet as pq
  schema = pq.read_schema(next((tmp_path / "data").glob("part-*.parquet")))
  assert schema.field("tokens").type.value_type == "int32"

  # `eval` on the file's held-out problems scores what the built-in task scores on the same problems.
  from train_td import __main__ as td_main
  assert td_main.main(["eval", "--model", "default", "--task", path, "--n", "4", "--batch", "4", "--json"]) == 0
  got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  want = evaluate.evaluate(model, "arithmetic", 4, evaluate.task_generation_config(
      type("A", (), {})(), model.path, "arithmetic"), problems=held, batch=4, warmup=False)
  assert got["n"] == 4 and got["correct"] == want["correct"] and got["mean_nfe"] == want["mean_nfe"]


# ------------------------------------------------------- TD on an architecture train_td does not build
def test_td_run_and_export_on_a_dense_llada_base(tmp_path):
  """A dense LLaDA (the golden tiny one: vocab 512, mask 509, no tokenizer): trajectories, a TD run with
  every loss term, and an export in the base's own format that loads back with the run's weights."""
  base_dir = tmp_path / "base"
  shutil.copytree(TINY_LLADA, base_dir,
                  ignore=shutil.ignore_patterns("*.npy", "meta.json"))
  (base_dir / "generation_config.json").write_text(json.dumps({"gen_length": 8, "block_length": 4}))
  base = dinfer_jax.load(base_dir)
  assert base.config.family == "llada"

  class AcceptAll(tasks_lib.ArithmeticTask):
    name = "td-any-answer"
    def check(self, problem, answer_text):  # a random model's trajectories, all kept
      return True
  tasks_lib.register_task(AcceptAll())
  gcfg = GenerationConfig(gen_length=8, block_length=4, threshold=0.5, cache="dual", prompt_bucket=16)
  cc = collect_lib.CollectConfig(model=str(base_dir), task="td-any-answer", n=8, batch=8,
                                 generation=tuple(sorted(dataclasses.asdict(gcfg).items())))
  collect_lib.collect(base, cc, tmp_path / "data", progress=False)
  rec = td_data.read_records(tmp_path / "data")
  assert len(rec["index"]) == 8 and max(max(t) for t in rec["tokens"]) < 512
  assert any(t > 127 for toks in rec["tokens"] for t in toks)  # ids past the char vocabulary survive

  tdc = td_train.TDConfig(data=str(tmp_path / "data"), base=str(base_dir), mdm_weight=0.5, cf_weight=0.5)
  out = td_train.train(tdc, tmp_path / "run", progress=False, steps=2, batch_size=4, warmup_steps=0, lr=1e-2,
                       log_every=1, ckpt_every=1)
  saved = json.loads((tmp_path / "run" / trainer.TRAIN_CONFIG).read_text())
  assert saved["arch_from"] == str(base_dir) and "d_model" not in saved  # no train_td shape recorded
  assert trainer.load_train_config(tmp_path / "run").model_config().family == "llada"
  moved = [not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(out["params"]),
                                                     jax.tree_util.tree_leaves(params_lib.stack_layers(base.params)))]
  assert any(moved)

  res = export_lib.export_run(tmp_path / "run", tmp_path / "td")
  td = dinfer_jax.load(tmp_path / "td")
  assert dataclasses.replace(td.config, moe_impl=base.config.moe_impl) == base.config
  for a, b in zip(jax.tree_util.tree_leaves(params_lib.stack_layers(td.params)), jax.tree_util.tree_leaves(out["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  want = json.loads((base_dir / "config.json").read_text())
  assert json.loads((tmp_path / "td" / "config.json").read_text()) == dict(want, torch_dtype="float32")
  assert json.loads((tmp_path / "td" / "generation_config.json").read_text()) == {"gen_length": 8,
                                                                                  "block_length": 4}
  assert res["step"] == 2 and "tokenizer.json" not in res["files"]  # the base has none: none invented
  r = dinfer_jax.generate(td, [[4, 20, 21, 5]], gcfg)
  assert r.tokens[0] is not None and r.nfe >= 1


@pytest.mark.parametrize("rows,n,want", [
    ([("train", 5), ("test", 3)], 10, r"--n 10 asks for 10 distinct training problems; the task has 5 \(and 3 held-out"),
    ([("test", 4)], 1, r"--n 1 asks for 1 distinct training problems; the task has 0 \(and 4 held-out"),
])
def test_collect_checks_n_against_the_file_before_writing(tmp_path, rows, n, want):
  recs = [{"prompt": f"What is {i} + {k}?", "answer": str(i + k), "split": split}
          for k, (split, count) in enumerate(rows) for i in range(count)]
  path = _write(tmp_path / "few.jsonl", recs)
  out = tmp_path / "out"
  cc = collect_lib.CollectConfig(model="default", task=path, n=n, seed=0, batch=4, generation=())
  with pytest.raises(ValueError, match=want):
    collect_lib.collect(None, cc, out, progress=False)  # no model needed: it fails before using one
  assert not out.exists()
  # The CLI: one line, before the model is loaded, nothing written; the corrected rerun then goes on.
  from train_td.__main__ import main
  assert main(["collect", "--task", path, "--n", str(n), "--out", str(out)]) == 2
  assert not out.exists()
  # What the file has is still served, every training row once.
  got = list(itertools.islice(tasks_lib.iter_problems(tasks_lib.get_task(path), "train", 0, unique=True),
                              dict(rows).get("train", 0)))
  assert sorted(p.prompt for p in got) == sorted(r["prompt"] for r in recs if r["split"] == "train")


def test_collect_refuses_a_directory_that_is_not_a_collect_dir(tmp_path):
  path = _write(tmp_path / "t.jsonl", [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "split": "train"}
                                       for i in range(3)])
  out = tmp_path / "mine"
  out.mkdir()
  (out / "notes.txt").write_text("mine")
  from train_td.__main__ import main
  assert main(["collect", "--task", path, "--n", "2", "--out", str(out)]) == 2
  assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_task_file_not_utf8_names_the_file(tmp_path):
  (tmp_path / "bad.jsonl").write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
  with pytest.raises(ValueError, match=r"task file .*bad\.jsonl:2: not UTF-8 text \(byte 0xe9 at offset 47\)"):
    tasks_lib.get_task(str(tmp_path / "bad.jsonl"))
