"""The lm-eval model: registration, generate_until (batched, `until`, max_gen_toks), loglikelihood and
is_greedy against plain computations, and an offline lm-eval run on the embedded model's task scoring
what `train_td eval` scores."""
import importlib.metadata
import json

import numpy as np
import pytest

pytest.importorskip("lm_eval")

import dinfer_jax  # noqa: E402
from dinfer_jax import cli, cli_common  # noqa: E402
from dinfer_jax.evaluation import loglik  # noqa: E402
from dinfer_jax.evaluation.lm_eval_model import DinferJaxLM  # noqa: E402


class Req:  # what lm-eval hands a model: an object with .args
  def __init__(self, *args):
    self.args = args


@pytest.fixture(scope="module")
def lm():
  return DinferJaxLM(pretrained="default", batch_size=4, mc_num=32, mc_batch_size=16)


def _chat(lm, q):
  return lm.apply_chat_template([{"role": "user", "content": q}])


def test_registered_for_lm_eval():
  from lm_eval.api.registry import get_model
  assert get_model("dinfer_jax") is DinferJaxLM
  eps = importlib.metadata.entry_points(group="lm_eval.models")
  assert any(e.name == "dinfer_jax" and e.value.endswith(":DinferJaxLM") for e in eps)


def test_model_args_become_generation_knobs():
  lm = DinferJaxLM.create_from_arg_string("pretrained=default,threshold=0.8,cache=prefix,batch_size=2")
  assert lm.gcfg.threshold == 0.8 and lm.gcfg.cache == "prefix" and lm.batch_size == 2
  assert lm.gcfg.gen_length == 8  # the model's generation_config.json fills what was not given
  with pytest.raises(ValueError, match="unknown model_args key 'thresh'"):
    DinferJaxLM(pretrained="default", thresh=0.5)


@pytest.mark.slow  # over 20 s on 2 cores: -m slow
def test_generate_until_batches_and_honours_until_and_max_gen_toks(lm):
  qs = ["What is 348+279?", "f(0..5)=2,5,8,11,14,17", "12 x 13", "f(0..5)=1,3,5,7,9,11", "905-417"]
  ctx = [_chat(lm, q) for q in qs]
  alone = [lm.model.tokenizer.decode(dinfer_jax.generate(lm.model, [lm._encode(c)], lm.gcfg).tokens[0],
                                     skip_special_tokens=True) for c in ctx]
  assert alone[1] == "x*3+2"
  reqs = [Req(c, {"until": [], "max_gen_toks": 8}) for c in ctx]
  reqs += [Req(ctx[1], {"until": ["+"], "max_gen_toks": 8}),  # cut before the stop sequence
           Req(ctx[1], {"until": "*", "max_gen_toks": 8}),
           Req(ctx[1], {"until": [], "max_gen_toks": 2})]  # cut to two tokens
  before = lm.stats()["requests"]
  out = lm.generate_until(reqs)
  assert out[:5] == alone
  assert out[5:] == ["x*3", "x", "x*"]
  s = lm.stats()
  assert s["requests"] - before == 8 and s["tpf"] > 0 and s["tps"] > 0 and s["nfe_per_request"] > 0


def _greedy_reference(model, context, L):
  """LLaDA's low-confidence decode of L positions, one token per step, from plain forwards: commit the
  argmax of the most confident masked position (lowest index on ties)."""
  mask = model.config.mask_token_id
  x = list(context) + [mask] * L
  for _ in range(L):
    logits = np.asarray(dinfer_jax.forward(model, [x])[0], np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    cand = [(-p[i].max(), i) for i in range(len(context), len(x)) if x[i] == mask]
    _, i = min(cand)
    x[i] = int(p[i].argmax())
  return x[len(context):]


def test_loglikelihood_is_the_mc_estimate_and_is_greedy_the_greedy_decode(lm):
  ctx = _chat(lm, "What is 348+279?")
  ids = lm._encode(ctx)
  greedy = _greedy_reference(lm.model, ids, 4)
  cont = lm._decode(greedy)
  other = " 111" if cont != " 111" else " 222"
  res = lm.loglikelihood([Req(ctx, cont), Req(ctx, other)])
  c_ids, t_ids = lm._encode_pair(ctx, cont)
  assert c_ids == ids and t_ids == greedy
  want = loglik.mc_loglikelihood(lm.model, c_ids, t_ids, mc_num=32, batch_size=16, seed=0)[0]
  assert res[0][0] == pytest.approx(want, abs=1e-6)
  assert res[0][1] is True and res[1][1] is False
  assert res[0][0] > res[1][0]  # the model's own answer is the likelier one


def test_loglikelihood_rolling_is_refused(lm):
  with pytest.raises(NotImplementedError, match="rolling"):
    lm.loglikelihood_rolling([Req("abc")])


def test_offline_lm_eval_scores_what_train_td_eval_scores(monkeypatch, tmp_path, capsys):
  """lm-eval on the embedded model's arithmetic task (local JSONL, no download) gets the accuracy that
  train_td's evaluator gets on the same held-out problems."""
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  from dinfer_jax import tasks
  from train_td import evaluate
  n = 48
  from dinfer_jax.evaluation.cli import TASKS_DIR
  rows = [json.loads(l) for l in (TASKS_DIR / "embedded" / "arithmetic_test.jsonl").read_text().splitlines()]
  assert [r["prompt"] for r in rows[:n]] == [p.prompt for p in tasks.test_problems("arithmetic", n, 0)]
  model = dinfer_jax.load("default")
  gcfg = cli_common.generation_config(cli.build_parser().parse_args(["generate", "x"]), model.path)
  ref = evaluate.evaluate(model, "arithmetic", n, gcfg, batch=16, warmup=False)
  out = tmp_path / "r.json"
  assert cli.main(["lm-eval", "--tasks", "dinfer_default_arithmetic", "--limit", str(n),
                   "--model-args", "batch_size=16", "--json", str(out)]) == 0
  res = json.loads(out.read_text())
  acc = res["results"]["dinfer_default_arithmetic"]["acc,none"]
  assert acc == pytest.approx(ref["accuracy"]) and 0.5 < acc
  assert res["dinfer_jax"]["requests"] == n and res["dinfer_jax"]["tpf"] == pytest.approx(ref["tpf"])
  printed = capsys.readouterr().out
  assert "dinfer_default_arithmetic" in printed and "TPF" in printed


@pytest.mark.slow  # compiles/indexes more than the default suite can afford
def test_repo_task_yamls_are_indexed_and_mbpp_scoring_runs_code():
  from lm_eval.tasks import TaskManager

  from dinfer_jax.evaluation.cli import TASKS_DIR
  from dinfer_jax.evaluation.tasks import mbpp_utils
  names = set(TaskManager(include_path=str(TASKS_DIR)).all_tasks)
  assert {"gsm8k_llada_moe", "mbpp_sanitized_llada_moe", "dinfer_default_arithmetic",
          "dinfer_default_program"} <= names
  tests = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
  good = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
  assert mbpp_utils.process_results({"test_list": tests}, [good]) == {"pass_at_1": 1.0}
  assert mbpp_utils.process_results({"test_list": tests}, [good.replace("a + b", "a - b")]) == {"pass_at_1": 0.0}
  assert not mbpp_utils.passes("def f():\n  while True: pass", "", ["assert f() == 1"], timeout=1.0)
