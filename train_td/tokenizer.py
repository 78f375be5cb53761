"""Character-level tokenizer for the small verifiable-task models.

One token per character keeps the vocabulary tiny (the embedding of a few-million-parameter model would
otherwise dominate it) and makes digits, operators and expression syntax individually visible to the
model, which is what arithmetic and short expressions need. Layout (ids are stable; checkpoints depend
on them):

  0 <|pad|>  1 <|eos|>  2 <|mask|>  3 <|unk|>  4 <|user|>  5 <|assistant|>
  6..102    the 95 printable ASCII characters (space..~), then "\\n" and "\\t"
  103..127  <|reserved_0|>..<|reserved_24|>: room for future special tokens without moving any id,
            and a vocabulary size that is a multiple of 64.

Anything else (e.g. "é") encodes to <|unk|>. Prompt format: "<|user|>{prompt}<|assistant|>{answer}<|eos|>",
where {prompt} is the task's internal prompt ("348+279", " 40+  2", "f(0..5)=2,5,8,11,14,17"). The
saved chat_template normalises a natural question onto that prompt exactly like `format_prompt` does, so
`dinfer-jax generate "What is 40 + 2?"` reaches the model as "<|user|> 40+  2<|assistant|>".
"""
from __future__ import annotations

import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from dinfer_jax.hf_quiet import import_transformers

import_transformers()  # without its "PyTorch was not found" advice
from transformers import PreTrainedTokenizerFast  # noqa: E402

PAD_TOKEN, EOS_TOKEN, MASK_TOKEN, UNK_TOKEN = "<|pad|>", "<|eos|>", "<|mask|>", "<|unk|>"
USER_TOKEN, ASSISTANT_TOKEN = "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, MASK_TOKEN, UNK_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)
PAD_ID, EOS_ID, MASK_ID, UNK_ID, USER_ID, ASSISTANT_ID = range(len(SPECIAL_TOKENS))
CHARACTERS = tuple(chr(c) for c in range(32, 127)) + ("\n", "\t")
VOCAB_SIZE = 128
RESERVED_TOKENS = tuple(
    f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(CHARACTERS)))

# Question normalisation (arithmetic only). Applied in this order, after lower-casing and removing all
# whitespace, so "What  is" and "multiplied by" match however they are spaced. Plain str.replace steps
# only: the chat template below repeats them in Jinja, and both must agree on every input.
_WHITESPACE = (" ", "\t", "\n", "\r")
_QUESTION_WORDS = ("whatis", "what's", "what\u2019s", "howmuchis", "calculate", "compute", "please")
_OPERATOR_WORDS = (("multipliedby", "*"), ("times", "*"), ("plus", "+"), ("minus", "-"),
                   ("\u00d7", "*"), ("\u2212", "-"), ("x", "*"))
_DROPPED = ("?", "=", "!")
# Arithmetic operands are right-aligned to this width (ArithmeticTask.max_digits), as the task writes them.
OPERAND_WIDTH = 3
_OPERATORS = ("+", "-", "*")
# Program-synthesis prompts ("f(0..5)=5,8,...") contain this and pass through unchanged (but stripped).
PROGRAM_MARKER = "f("
# Sorting prompts start with this word; numbers separated by commas and/or whitespace are rewritten as the
# task writes them: "sort 4, 0 9" -> "sort:4,0,9" (SortTask.digits wide, zero padded).
SORT_WORD = "sort"
SORT_DIGITS = 1
# Sums with an operand wider than OPERAND_WIDTH go to the long-addition task: "add:" and both operands
# right-aligned to ADD_WIDTH columns (LongAddTask.max_digits); "add:" prompts are re-aligned the same way.
ADD_PREFIX = "add:"
ADD_WIDTH = 24
# "split 73" / "Split: 73." asks for two numbers adding up to 73: "split:" + the number right-aligned to
# SPLIT_DIGITS columns (SplitTask.digits), as the task writes it; other text after the word is left as it is.
SPLIT_WORD = "split"
SPLIT_DIGITS = 3


def format_prompt(question: str) -> str:
  """Maps a natural question onto the internal prompt format.

  "What is 348 + 279?", "348 plus 279 =", "what's 12 x 13" and "12 times 13." become "348+279" and
  " 12* 13" (operands of at most OPERAND_WIDTH digits right-aligned to it); a sum with a wider operand
  (up to ADD_WIDTH digits) becomes a long-addition prompt "add:" + both operands right-aligned to
  ADD_WIDTH; prompts already in the internal format are returned unchanged (the mapping is idempotent).
  Program-synthesis prompts (containing "f(") are only stripped.

  Args:
    question: Free text from a user.

  Returns:
    The prompt text the model was trained on.
  """
  q = question.strip()
  if PROGRAM_MARKER in q:
    return q
  if q.lower().startswith(SORT_WORD):
    return _format_sort(q)
  if q.lower().startswith(SPLIT_WORD):
    return _format_split(q)
  q = q.lower()
  for w in _WHITESPACE + _QUESTION_WORDS:
    q = q.replace(w, "")
  for w, op in _OPERATOR_WORDS:
    q = q.replace(w, op)
  for w in _DROPPED:
    q = q.replace(w, "")
  q = q.rstrip(".")
  if q.startswith(ADD_PREFIX):
    q = q[len(ADD_PREFIX):]
  for op in _OPERATORS:
    parts = q.split(op)
    if len(parts) == 2 and all(p.isdigit() and len(p) <= OPERAND_WIDTH for p in parts):
      q = parts[0].rjust(OPERAND_WIDTH) + op + parts[1].rjust(OPERAND_WIDTH)
    elif op == "+" and len(parts) == 2 and all(p.isdigit() and len(p) <= ADD_WIDTH for p in parts):
      q = ADD_PREFIX + parts[0].rjust(ADD_WIDTH) + op + parts[1].rjust(ADD_WIDTH)
  return q


def _format_sort(q: str) -> str:
  """"Sort: 4, 0 9." -> "sort:4,0,9"; text that is not a list of small numbers is left as it is."""
  body = q[len(SORT_WORD):].lstrip(":").rstrip(".")
  for w in _WHITESPACE:
    body = body.replace(w, ",")
  parts = [p for p in body.split(",") if p]
  if parts and all(p.isdigit() and len(p) <= SORT_DIGITS for p in parts):
    return SORT_WORD + ":" + ",".join(p.zfill(SORT_DIGITS) for p in parts)
  return q


def _format_split(q: str) -> str:
  """"Split: 73." -> "split: 73"; text that is not one number of at most SPLIT_DIGITS digits is left as it is."""
  body = q[len(SPLIT_WORD):].lstrip(":").rstrip(".")
  for w in _WHITESPACE:
    body = body.replace(w, "")
  if body.isdigit() and len(body) <= SPLIT_DIGITS:
    return SPLIT_WORD + ":" + body.rjust(SPLIT_DIGITS)
  return q


def format_chat(question: str, answer: str | None = None) -> str:
  """The model's full text for one exchange: what the chat template renders for it.

  Args:
    question: User question or internal prompt (normalised with `format_prompt`).
    answer: Reference answer; None renders the generation prompt (ending in <|assistant|>).
  """
  text = USER_TOKEN + format_prompt(question) + ASSISTANT_TOKEN
  return text if answer is None else text + answer + EOS_TOKEN


def _jinja_str(s: str) -> str:
  # JSON escapes are valid Jinja string-literal escapes (Jinja decodes literals with unicode-escape).
  return json.dumps(s)


def _chat_template() -> str:
  normalise = "".join(f"{{%- set q = q.replace({_jinja_str(w)}, '') -%}}"
                      for w in _WHITESPACE + _QUESTION_WORDS)
  normalise += "".join(f"{{%- set q = q.replace({_jinja_str(w)}, {_jinja_str(op)}) -%}}"
                       for w, op in _OPERATOR_WORDS)
  normalise += "".join(f"{{%- set q = q.replace({_jinja_str(w)}, '') -%}}" for w in _DROPPED)
  # Jinja's `set` inside a loop does not leak out of it, hence the namespace; "%3s" right-aligns.
  align = (
      "{%- set ns.q = q -%}"
      f"{{%- for op in {json.dumps(list(_OPERATORS))} -%}}"
      "{%- set parts = ns.q.split(op) -%}"
      "{%- if parts | length == 2 and parts[0].isdigit() and parts[1].isdigit()"
      f" and parts[0] | length <= {OPERAND_WIDTH} and parts[1] | length <= {OPERAND_WIDTH} -%}}"
      f"{{%- set ns.q = '%{OPERAND_WIDTH}s' | format(parts[0]) + op + '%{OPERAND_WIDTH}s' | format(parts[1]) -%}}"
      "{%- elif op == '+' and parts | length == 2 and parts[0].isdigit() and parts[1].isdigit()"
      f" and parts[0] | length <= {ADD_WIDTH} and parts[1] | length <= {ADD_WIDTH} -%}}"
      f"{{%- set ns.q = {_jinja_str(ADD_PREFIX)} + '%{ADD_WIDTH}s' | format(parts[0]) + op"
      f" + '%{ADD_WIDTH}s' | format(parts[1]) -%}}"
      "{%- endif -%}"
      "{%- endfor -%}")
  # Same steps as _format_sort; `select` drops the empty strings that runs of separators leave.
  sort = (
      f"{{%- set body = q[{len(SORT_WORD)}:].lstrip(':').rstrip('.') -%}}"
      + "".join(f"{{%- set body = body.replace({_jinja_str(w)}, ',') -%}}" for w in _WHITESPACE) +
      "{%- set parts = body.split(',') | select | list -%}"
      "{%- set ns.ok = parts | length > 0 -%}"
      "{%- for p in parts -%}"
      f"{{%- if not (p.isdigit() and p | length <= {SORT_DIGITS}) -%}}{{%- set ns.ok = false -%}}{{%- endif -%}}"
      "{%- endfor -%}"
      "{%- if ns.ok -%}"
      f"{{%- set ns.q = {_jinja_str(SORT_WORD + ':')} -%}}"
      "{%- for p in parts -%}"
      f"{{%- set ns.q = ns.q + ('' if loop.first else ',') + p.zfill({SORT_DIGITS}) -%}}"
      "{%- endfor -%}"
      "{%- endif -%}")
  # Same steps as _format_split.
  split = (
      f"{{%- set body = q[{len(SPLIT_WORD)}:].lstrip(':').rstrip('.') -%}}"
      + "".join(f"{{%- set body = body.replace({_jinja_str(w)}, '') -%}}" for w in _WHITESPACE) +
      f"{{%- if body.isdigit() and body | length <= {SPLIT_DIGITS} -%}}"
      f"{{%- set ns.q = {_jinja_str(SPLIT_WORD + ':')} + '%{SPLIT_DIGITS}s' | format(body) -%}}"
      "{%- endif -%}")
  return (
      "{%- for message in messages -%}"
      "{%- if message['role'] == 'user' -%}"
      "{%- set q = message['content'] | trim -%}"
      "{%- set ns = namespace(q=q, ok=false) -%}"
      f"{{%- if (q | lower).startswith({_jinja_str(SORT_WORD)}) -%}}" + sort +
      f"{{%- elif (q | lower).startswith({_jinja_str(SPLIT_WORD)}) -%}}" + split +
      f"{{%- elif {_jinja_str(PROGRAM_MARKER)} not in q -%}}"
      "{%- set q = q | lower -%}" + normalise + "{%- set q = q.rstrip('.') -%}" +
      f"{{%- if q.startswith({_jinja_str(ADD_PREFIX)}) -%}}{{%- set q = q[{len(ADD_PREFIX)}:] -%}}{{%- endif -%}}" + align +
      "{%- endif -%}"
      f"{{{{- {_jinja_str(USER_TOKEN)} + ns.q -}}}}"
      "{%- elif message['role'] == 'assistant' -%}"
      f"{{{{- {_jinja_str(ASSISTANT_TOKEN)} + message['content'] + {_jinja_str(EOS_TOKEN)} -}}}}"
      "{%- endif -%}"
      "{%- endfor -%}"
      f"{{%- if add_generation_prompt -%}}{{{{- {_jinja_str(ASSISTANT_TOKEN)} -}}}}{{%- endif -%}}")


CHAT_TEMPLATE = _chat_template()


def build_raw_tokenizer() -> Tokenizer:
  """The `tokenizers` object: WordLevel over single characters, specials matched first."""
  vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARACTERS + RESERVED_TOKENS)}
  assert len(vocab) == VOCAB_SIZE, "characters or special tokens are duplicated"
  tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
  # Every character is its own piece (newlines included, hence [\s\S] rather than "."); the decoder
  # concatenates pieces back without inserting spaces, so decode(encode(s)) == s.
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(list(SPECIAL_TOKENS + RESERVED_TOKENS))
  return tok


def build_tokenizer() -> PreTrainedTokenizerFast:
  """The tokenizer as a transformers object, with special tokens and chat template set."""
  return PreTrainedTokenizerFast(
      tokenizer_object=build_raw_tokenizer(), pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
      # `additional_special_tokens`, not transformers 5's `extra_special_tokens`: 4.x reads that name as a
      # dict of named tokens and fails on a list; 5.x still accepts this one.
      mask_token=MASK_TOKEN, unk_token=UNK_TOKEN, additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN],
      # The default cleanup would turn "3 ." into "3." and break the round trip.
      clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE)


def save_tokenizer(directory: str | os.PathLike) -> PreTrainedTokenizerFast:
  """Writes tokenizer.json, tokenizer_config.json (and friends) for `AutoTokenizer.from_pretrained`.

  Returns:
    The saved tokenizer.
  """
  tok = build_tokenizer()
  tok.save_pretrained(os.fspath(directory))
  # The file must load under every transformers version pyproject allows (4.52.4 .. 5.x; CI tests both
  # ends). transformers 5 records its internal class name ("TokenizersBackend"), which 4.x cannot
  # resolve: "PreTrainedTokenizerFast" loads the same tokenizer.json under both. It also writes the
  # user/assistant tokens as an `extra_special_tokens` list, which 4.x takes for a dict and fails on
  # ("'list' object has no attribute 'keys'"); `additional_special_tokens` is read by both.
  config_path = os.path.join(os.fspath(directory), "tokenizer_config.json")
  with open(config_path) as f:
    config = json.load(f)
  config["tokenizer_class"] = "PreTrainedTokenizerFast"
  config.pop("extra_special_tokens", None)
  config["additional_special_tokens"] = [USER_TOKEN, ASSISTANT_TOKEN]
  with open(config_path, "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
    f.write("\n")
  return tok


def special_token_ids() -> dict[str, int]:
  """Ids of the special tokens, by token text."""
  return {t: i for i, t in enumerate(SPECIAL_TOKENS)}
