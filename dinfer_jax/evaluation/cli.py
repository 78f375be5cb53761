"""`dinfer-jax lm-eval --tasks T[,T...] [--model PATH] [--model-args k=v,...] [--limit N] [--json FILE]`:
lm-evaluation-harness on a dinfer-jax model, with this repo's task YAMLs on the include path and the
decoding statistics (TPS, TPF, NFE) printed beside the scores. Needs the `eval` extra (lm-eval)."""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess

from dinfer_jax import cli_common

TASKS_DIR = pathlib.Path(__file__).parent / "tasks"


def register(subparsers) -> None:
  e = subparsers.add_parser("lm-eval", help="lm-evaluation-harness on a model (scores + TPS/TPF/NFE)",
                            description=__doc__)
  cli_common.add_model_flags(e, dtype=False)  # the dtype goes in --model-args, as lm-eval passes it
  e.add_argument("--model-args", default="", help="comma list of k=v: dtype, batch_size, mc_num, mc_batch_size, "
                 "seed, and GenerationConfig knobs (gen_length=256,cache=dual,...)")
  e.add_argument("--tasks", required=True, help="comma list, e.g. dinfer_default_arithmetic or gsm8k_llada_moe")
  e.add_argument("--include-path", default=None, help=f"more task YAMLs (this repo's are always included: {TASKS_DIR})")
  e.add_argument("--limit", type=float, default=None, help="examples per task (or a fraction if < 1)")
  e.add_argument("--num-fewshot", type=int, default=None)
  e.add_argument("--apply-chat-template", action="store_true", help="wrap prompts in the model's chat template")
  e.add_argument("--confirm-run-unsafe-code", action="store_true", help="allow tasks that run model-written code")
  e.add_argument("--json", dest="json_out", default=None, help="write scores and decoding statistics here")
  e.set_defaults(func=cmd_lm_eval)


def _quiet_git_hash() -> str | None:
  try:
    return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).decode().strip()
  except (OSError, subprocess.CalledProcessError):
    return None


def run(model_path: str, model_args: str, tasks: list[str], *, include_path: str | None = None,
        limit: float | None = None, num_fewshot: int | None = None, apply_chat_template: bool = False,
        confirm_run_unsafe_code: bool = False) -> dict:
  """Runs lm-eval; returns its results dict with our decoding statistics under "dinfer_jax"."""
  import lm_eval
  import lm_eval.evaluator
  from lm_eval.tasks import TaskManager
  from lm_eval.utils import simple_parse_args_string

  # lm-eval records the git commit of the working directory by running git with its stderr open: outside a
  # checkout a user saw "fatal: not a git repository" printed in the middle of an evaluation.
  lm_eval.evaluator.get_git_commit_hash = _quiet_git_hash

  from dinfer_jax.evaluation.lm_eval_model import DinferJaxLM  # the eval extra (lm-eval)
  kw = simple_parse_args_string(model_args) if model_args else {}
  lm = DinferJaxLM(pretrained=model_path, **kw)
  paths = [str(TASKS_DIR)] + ([include_path] if include_path else [])
  res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_path=paths),
                                limit=limit, num_fewshot=num_fewshot, apply_chat_template=apply_chat_template,
                                confirm_run_unsafe_code=confirm_run_unsafe_code, log_samples=False)
  res["dinfer_jax"] = lm.stats()
  return res


def cmd_lm_eval(args: argparse.Namespace) -> int:
  try:
    from lm_eval.utils import make_table
  except ImportError:
    raise SystemExit("error: dinfer-jax lm-eval needs the eval extra: pip install 'dinfer-jax[eval]'") from None
  tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
  res = run(args.model, args.model_args, tasks, include_path=args.include_path, limit=args.limit,
            num_fewshot=args.num_fewshot, apply_chat_template=args.apply_chat_template,
            confirm_run_unsafe_code=args.confirm_run_unsafe_code)
  print(make_table(res))
  s = res["dinfer_jax"]
  print(f"decoding: {s['requests']} requests, {s['tokens']} tokens, TPF {s['tpf']:.2f}, TPS {s['tps']:.1f} "
        f"(engine seconds incl. compiles), NFE per request {s['nfe_per_request']:.2f}")
  if args.json_out:
    out = {"results": res["results"], "dinfer_jax": s, "config": {"model": args.model, "model_args": args.model_args,
                                                                    "tasks": tasks, "limit": args.limit}}
    pathlib.Path(args.json_out).write_text(json.dumps(out, indent=1, default=str))
  return 0

