"""Deterministic tokenized training batches from the verifiable tasks.

Batch for step s is a pure function of (seed, s): the task of the batch is drawn from the mix with a
generator seeded by (seed, s), and its problems are the first `batch_size` of
`iter_problems(task, "train", seed=derived)`. So resuming at step s needs no replay. Each batch holds one
task, so a batch's width is that task's bucket (arithmetic prompts are 9 tokens, program prompts at most 33,
sort prompts at most 54, long additions 55, splits 11; sort answers get a region of 48, long additions 32, the others
answer_len):

  row:  [ pad ... | <|user|> prompt <|assistant|> | answer <|eos|> <|eos|> ... ]
          prompt_width                              answer_len
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from dinfer_jax import tasks as tasks_lib
from train_td import tokenizer as tok_lib

DEFAULT_MIX = (("arithmetic", 0.65), ("program", 0.35))
# Training frequency of "+", "-", "*" within arithmetic batches. Multiplication by a digit (carries up to
# 8, every column depends on the one below) is the part a small model learns last: the first model of
# this design got every held-out sum and difference right and ~2/3 of the products, with uniform ops.
# Held-out sets are always drawn uniformly from the registered task.
DEFAULT_ARITHMETIC_OP_WEIGHTS = (1.0, 1.0, 2.0)
DEFAULT_PROMPT_WIDTH = {"arithmetic": 10, "program": 34, "sort": 54, "add": 55, "split": 12}
# Answer regions of the long-answer tasks (the others use DataConfig.answer_len): a sort answer is at most
# 47 characters (24 digits and their commas) plus <|eos|>, i.e. six blocks of 8 at generation time.
# A long-addition answer is 25 characters (the sum right-aligned) plus <|eos|>: four blocks of 8.
DEFAULT_TASK_ANSWER_LEN = {"sort": 48, "add": 32}

_VOCAB = None


def _vocab() -> dict[str, int]:
  global _VOCAB
  if _VOCAB is None:
    _VOCAB = tok_lib.build_raw_tokenizer().get_vocab()
  return _VOCAB


def encode_text(text: str) -> list[int]:
  """Characters -> ids (the tokenizer's single-character pieces; unknown -> <|unk|>)."""
  v = _vocab()
  return [v.get(c, tok_lib.UNK_ID) for c in text]


def encode_prompt(prompt: str) -> list[int]:
  """<|user|>prompt<|assistant|> as ids (prompt already in the internal format)."""
  return [tok_lib.USER_ID] + encode_text(prompt) + [tok_lib.ASSISTANT_ID]


@dataclasses.dataclass(frozen=True)
class DataConfig:
  mix: tuple[tuple[str, float], ...] = DEFAULT_MIX
  batch_size: int = 64
  answer_len: int = 8
  prompt_width: tuple[tuple[str, int], ...] = tuple(DEFAULT_PROMPT_WIDTH.items())
  seed: int = 0
  arithmetic_op_weights: tuple[float, ...] | None = DEFAULT_ARITHMETIC_OP_WEIGHTS
  task_answer_len: tuple[tuple[str, int], ...] = tuple(DEFAULT_TASK_ANSWER_LEN.items())
  # Canvas lengths a batch's answer region is drawn from, with weights (empty: each task's fixed region).
  # A task draws among the lengths at least its own region (long sums: 32 and 64 of 8,16,32,64), and a
  # longer canvas gets proportionally fewer rows, so every step costs about the same tokens.
  canvases: tuple[tuple[int, float], ...] = ()

  def __post_init__(self):
    if not self.mix:
      raise ValueError("mix: no task given (e.g. arithmetic=0.7,program=0.3)")
    for name, w in self.mix:
      if name not in tasks_lib.task_names():
        raise ValueError(f"mix: unknown task {name!r}; known: {', '.join(tasks_lib.task_names())}")
      if not (isinstance(w, (int, float)) and np.isfinite(w) and w > 0):
        raise ValueError(f"mix: weight of {name!r} must be a number > 0, got {w!r}")
    if self.batch_size < 1 or self.answer_len < 1:
      raise ValueError(f"batch_size and answer_len must be >= 1, got {self.batch_size}, {self.answer_len}")
    for length, w in self.canvases:
      if not (isinstance(length, int) and length >= 1 and np.isfinite(w) and w > 0):
        raise ValueError(f"canvases: need LENGTH=WEIGHT with an int length >= 1 and weight > 0, got {length}={w}")
    for name, _ in self.mix:
      if self.canvases and not self.canvas_choices(name)[0]:
        raise ValueError(f"canvases: none of {[c for c, _ in self.canvases]} holds task {name!r}'s answer region "
                         f"of {self.answer_len_for(name)} tokens")
    if self.arithmetic_op_weights is not None:
      self.train_task("arithmetic")  # ArithmeticTask validates the weights (count, sign) here, not mid-run

  def width(self, task: str) -> int:
    return dict(self.prompt_width)[task]

  def answer_len_for(self, task: str) -> int:
    return dict(self.task_answer_len).get(task, self.answer_len)

  def canvas_choices(self, task: str) -> tuple[list[int], np.ndarray]:
    """(lengths, probabilities) of the answer region of `task`'s batches."""
    base = self.answer_len_for(task)
    if not self.canvases:
      return [base], np.ones(1)
    pairs = [(c, w) for c, w in self.canvases if c >= base]
    w = np.asarray([w for _, w in pairs], np.float64)
    return [c for c, _ in pairs], w / max(w.sum(), 1e-300)

  def rows_for(self, task: str, canvas: int) -> int:
    """Rows of a batch whose answer region is `canvas` long: batch_size at the task's own region, fewer
    (a multiple of 8, at least 8) for longer canvases, so the tokens per step stay about the same."""
    base, width = self.answer_len_for(task), self.width(task)
    if canvas == base:
      return self.batch_size
    return max(8, int(round(self.batch_size * (width + base) / (width + canvas) / 8)) * 8)

  def train_task(self, name: str) -> tasks_lib.Task:
    """The task training batches of `name` are drawn from (the registered one, reweighted if asked)."""
    task = tasks_lib.get_task(name)
    if name == "arithmetic" and self.arithmetic_op_weights is not None:
      task = dataclasses.replace(task, op_weights=tuple(float(w) for w in self.arithmetic_op_weights))
    return task


def make_rows(problems, prompt_width: int, answer_len: int) -> dict[str, np.ndarray]:
  """Tokenized, left-padded rows (tokens, valid, positions, answer) for a list of problems."""
  B, T = len(problems), prompt_width + answer_len
  tokens = np.full((B, T), tok_lib.PAD_ID, np.int32)
  valid = np.zeros((B, T), bool)
  positions = np.zeros((B, T), np.int32)
  answer = np.zeros((B, T), bool)
  answer[:, prompt_width:] = True
  for r, p in enumerate(problems):
    prompt = encode_prompt(p.prompt)
    # An answer that fills the region exactly has no room for <|eos|> (the canvas ends there instead).
    ans = encode_text(p.answer)
    ans = ans + [tok_lib.EOS_ID] * (len(ans) < answer_len)
    if len(prompt) > prompt_width:
      raise ValueError(f"prompt of {len(prompt)} tokens exceeds prompt_width={prompt_width}: {p.prompt!r}")
    if len(ans) > answer_len:
      raise ValueError(f"answer of {len(ans)} tokens exceeds answer_len={answer_len}: {p.answer!r}")
    pad = prompt_width - len(prompt)
    tokens[r, pad:prompt_width] = prompt
    tokens[r, prompt_width:] = tok_lib.EOS_ID
    tokens[r, prompt_width:prompt_width + len(ans)] = ans
    valid[r, pad:] = True
    positions[r] = np.maximum(np.arange(T) - pad, 0)
  return {"tokens": tokens, "valid": valid, "positions": positions, "answer": answer}


def batch_task(dcfg: DataConfig, step: int) -> str:
  names = [n for n, _ in dcfg.mix]
  w = np.asarray([w for _, w in dcfg.mix], np.float64)
  rng = np.random.default_rng([dcfg.seed, step, 7])
  return names[int(rng.choice(len(names), p=w / w.sum()))]


def get_batch(dcfg: DataConfig, step: int) -> tuple[str, dict[str, np.ndarray]]:
  """(task name, batch arrays) for a training step; a pure function of (dcfg, step)."""
  task = batch_task(dcfg, step)
  # A distinct, reproducible problem stream per (seed, step).
  stream_seed = int(np.random.default_rng([dcfg.seed, step, 11]).integers(2**62))
  it = tasks_lib.iter_problems(dcfg.train_task(task), "train", stream_seed)
  lengths, p = dcfg.canvas_choices(task)
  canvas = lengths[int(np.random.default_rng([dcfg.seed, step, 13]).choice(len(lengths), p=p))]
  problems = [next(it) for _ in range(dcfg.rows_for(task, canvas))]
  rows = make_rows(problems, dcfg.width(task), canvas)
  if dcfg.canvases:
    # The loss is normalised by the task's own region, not the canvas: a long canvas's EOS padding adds
    # terms without diluting the answer's (train_td.objective.masked_diffusion_loss).
    rows["norm_len"] = np.full(len(problems), dcfg.answer_len_for(task), np.float32)
  return task, rows


def n_tokens(batch: Mapping[str, np.ndarray]) -> int:
  return int(np.asarray(batch["valid"]).sum())
