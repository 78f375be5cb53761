"""Problems -> the token ids a model is prompted with, for collect and eval.

Two kinds of task (`Task.chat`):
- the built-in tasks write prompts in the internal format of train_td's character tokenizer ("348+279",
  " 40+  2"), encoded as <|user|>prompt<|assistant|> exactly as the models were trained;
- natural-language tasks (a JSONL file of your own problems) go through the model's own chat template,
  as `dinfer-jax generate` sends a user's question: how an HF checkpoint (LLaDA-MoE-7B-A1B) is prompted.
"""
from __future__ import annotations

from typing import Sequence

from dinfer_jax.cli_common import encode_prompts
from dinfer_jax.tasks import Problem, Task
from train_td import data as data_lib
from train_td import tokenizer as tok_lib


def is_char_tokenizer(tokenizer) -> bool:
  """Whether `tokenizer` is train_td's character tokenizer (the layout the built-in tasks are written in)."""
  if tokenizer is None or len(tokenizer) != tok_lib.VOCAB_SIZE:
    return False
  ids = tok_lib.special_token_ids()
  return tokenizer.convert_tokens_to_ids(list(ids)) == list(ids.values())


def _check(tokenizer, task: Task, where) -> None:
  if task.chat:
    if tokenizer is None:
      raise ValueError(f"task {task.name}: its prompts are text, but the model at {where} has no tokenizer")
  elif tokenizer is not None and not is_char_tokenizer(tokenizer):
    raise ValueError(f"task {task.name} is written for train_td's character tokenizer; the model at {where} "
                     "has another one (give it a FILE.jsonl task of natural-language problems)")


def prompt_ids(model, task: Task, problems: Sequence[Problem]) -> list[list[int]]:
  """The prompt token ids of `problems` for `model` (a dinfer_jax Model, or (params, cfg) for the
  built-in tasks)."""
  _check(getattr(model, "tokenizer", None), task, getattr(model, "path", None))
  if task.chat:
    return encode_prompts(model, [p.prompt for p in problems], warn=False)
  return [data_lib.encode_prompt(p.prompt) for p in problems]


def prompt_text(tokenizer, task: Task, problem: Problem, where=None) -> str:
  """The prompt as text: what a model's generation_config.json prompt rules are matched against."""
  _check(tokenizer, task, where)
  if task.chat:
    if getattr(tokenizer, "chat_template", None):
      return tokenizer.apply_chat_template([{"role": "user", "content": problem.prompt}], tokenize=False,
                                           add_generation_prompt=True)
    return problem.prompt
  return tok_lib.format_chat(problem.prompt)
