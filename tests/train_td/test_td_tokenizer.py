"""Character tokenizer: round trip, special ids, saving/loading, question mapping."""
import json
import random

import pytest
from transformers import AutoTokenizer

from dinfer_jax import tasks
from train_td import tokenizer as T


@pytest.fixture(scope="module")
def tok():
  return T.build_tokenizer()


@pytest.fixture(scope="module")
def task_texts():
  texts = []
  for name in ("arithmetic", "program", "sort", "add", "split"):
    for p in tasks.train_problems(name, 1000, seed=0) + tasks.test_problems(name, 100):
      texts += [p.prompt, p.answer, T.format_chat(p.prompt, p.answer)]
  return texts


def test_vocab_and_special_ids(tok):
  assert len(tok) == T.VOCAB_SIZE == 128
  assert (tok.pad_token_id, tok.eos_token_id, tok.mask_token_id, tok.unk_token_id) == (
      T.PAD_ID, T.EOS_ID, T.MASK_ID, T.UNK_ID) == (0, 1, 2, 3)
  assert tok.convert_tokens_to_ids([T.USER_TOKEN, T.ASSISTANT_TOKEN]) == [T.USER_ID, T.ASSISTANT_ID]
  assert T.special_token_ids() == {"<|pad|>": 0, "<|eos|>": 1, "<|mask|>": 2, "<|unk|>": 3,
                                   "<|user|>": 4, "<|assistant|>": 5}
  # One token per character.
  assert tok.encode("348+279", add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in "348+279"]


def test_round_trip_on_task_texts(tok, task_texts):
  raw = T.build_raw_tokenizer()
  for s in task_texts:
    ids = tok.encode(s, add_special_tokens=False)
    assert T.UNK_ID not in ids, s
    assert tok.decode(ids) == s
    assert raw.decode(raw.encode(s).ids, skip_special_tokens=False) == s


def test_round_trip_on_awkward_text(tok):
  for s in ["", " ", "  a  b ", "3 . 4", "x\n\ty", "What is 348 + 279?", "it's (a) [b] {c} ~`|\\",
            "<|mask|><|mask|>7<|eos|><|pad|>"]:
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


def test_special_tokens_are_single_ids(tok):
  ids = tok.encode("<|user|>3+4<|assistant|>7<|eos|><|mask|><|pad|>", add_special_tokens=False)
  assert ids == [4, 25, 17, 26, 5, 29, 1, 2, 0]
  assert tok.decode(ids, skip_special_tokens=True) == "3+47"


def test_unknown_characters_map_to_unk(tok):
  ids = tok.encode("é3\u6f22+\U0001f600", add_special_tokens=False)
  assert ids == [T.UNK_ID, tok.convert_tokens_to_ids("3"), T.UNK_ID, tok.convert_tokens_to_ids("+"),
                 T.UNK_ID]


def test_save_and_load_with_auto_tokenizer(tmp_path, task_texts):
  T.save_tokenizer(tmp_path)
  assert (tmp_path / "tokenizer.json").exists() and (tmp_path / "tokenizer_config.json").exists()
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert config["mask_token"] == "<|mask|>" and config["eos_token"] == "<|eos|>"
  assert config["pad_token"] == "<|pad|>" and config["unk_token"] == "<|unk|>"
  loaded = AutoTokenizer.from_pretrained(tmp_path)
  assert len(loaded) == T.VOCAB_SIZE
  assert (loaded.mask_token_id, loaded.eos_token_id, loaded.pad_token_id) == (T.MASK_ID, T.EOS_ID, T.PAD_ID)
  assert loaded.chat_template == T.CHAT_TEMPLATE
  original = T.build_tokenizer()
  for s in task_texts[:300]:
    ids = loaded.encode(s, add_special_tokens=False)
    assert ids == original.encode(s, add_special_tokens=False)
    assert loaded.decode(ids) == s


QUESTIONS = [
    ("What is 348+279?", "348+279"),
    ("What is 348 + 279", "348+279"),
    ("what is 348 + 279 ?", "348+279"),
    ("348 plus 279 =", "348+279"),
    ("What's 7 minus 9?", "  7-  9"),
    ("What\u2019s 7 - 9", "  7-  9"),
    ("12 times 13", " 12* 13"),
    ("12 x 13", " 12* 13"),
    ("12X13", " 12* 13"),
    ("12 \u00d7 13", " 12* 13"),
    ("What is 5 multiplied by 6?", "  5*  6"),
    ("Calculate 25*4.", " 25*  4"),
    ("  How much is 100 - 1 ?  ", "100-  1"),
    ("348+279", "348+279"),
    (" 40+  2", " 40+  2"),
    ("1234+5", "add:" + "1234".rjust(24) + "+" + "5".rjust(24)),  # wider than 3 digits: long addition
    ("What is 123456789012345678 + 987654321098765432?",
     "add:" + "123456789012345678".rjust(24) + "+" + "987654321098765432".rjust(24)),
    ("add:12345+678", "add:" + "12345".rjust(24) + "+" + "678".rjust(24)),
    ("add:1+2", "  1+  2"),  # small enough for the arithmetic columns
    ("1234-5", "1234-5"),  # only sums have a long form: left as typed
    ("1" * 25 + "+1", "1" * 25 + "+1"),  # wider than the long-addition columns: left as typed
    ("1+2+3", "1+2+3"),
    ("-4+5", "-4+5"),
    ("f(0..5)=2,5,8,11,14,17", "f(0..5)=2,5,8,11,14,17"),
    ("  f(0)=0;f(3)=9  ", "f(0)=0;f(3)=9"),
    ("sort 4, 0 9", "sort:4,0,9"),
    ("Sort: 5,3,1.", "sort:5,3,1"),
    ("SORT\t9\n1,,1", "sort:9,1,1"),
    ("sort:7,4", "sort:7,4"),
    ("sort 10, 2", "sort 10, 2"),  # too wide for the columns: left as typed
    ("sort the numbers 3 1", "sort the numbers 3 1"),
    ("sort", "sort"),
    ("split 73", "split: 73"),
    ("Split: 573.", "split:573"),
    ("split:  7", "split:  7"),
    ("SPLIT\t4 2", "split: 42"),
    ("split 1000", "split 1000"),  # wider than the columns: left as typed
    ("split 7 in two", "split 7 in two"),
]


@pytest.mark.parametrize("question,prompt", QUESTIONS)
def test_format_prompt(question, prompt):
  assert T.format_prompt(question) == prompt
  assert T.format_chat(question) == f"<|user|>{prompt}<|assistant|>"
  assert T.format_chat(question, "7") == f"<|user|>{prompt}<|assistant|>7<|eos|>"


def test_sort_columns_match_the_task():
  assert T.SORT_DIGITS == tasks.get_task("sort").digits
  assert T.ADD_WIDTH == tasks.get_task("add").max_digits
  assert T.SPLIT_DIGITS == tasks.get_task("split").digits


def test_format_prompt_is_identity_on_task_prompts():
  for name in ("arithmetic", "program", "sort", "add", "split"):
    for p in tasks.train_problems(name, 500, seed=1):
      assert T.format_prompt(p.prompt) == p.prompt


@pytest.mark.parametrize("where", ["saved", "shipped"])
def test_tokenizer_files_load_under_transformers_4_and_5(tmp_path, where):
  """transformers 4.x reads `extra_special_tokens` as a dict and failed on the list 5.x writes: the files
  use `additional_special_tokens`, which both read (.ci/run repeats this test on the lowest allowed
  transformers)."""
  from dinfer_jax import api
  d = tmp_path if where == "saved" else api.DEFAULT_MODEL_DIR
  if where == "saved":
    T.save_tokenizer(tmp_path)
  config = json.loads((d / "tokenizer_config.json").read_text())
  assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
  assert config["additional_special_tokens"] == [T.USER_TOKEN, T.ASSISTANT_TOKEN]
  assert not isinstance(config.get("extra_special_tokens", {}), list)
  loaded = AutoTokenizer.from_pretrained(d)
  assert sorted(loaded.all_special_tokens) == sorted(["<|pad|>", "<|eos|>", "<|mask|>", "<|unk|>", T.USER_TOKEN,
                                                      T.ASSISTANT_TOKEN])
  assert (loaded.pad_token_id, loaded.eos_token_id, loaded.mask_token_id, loaded.unk_token_id) == (0, 1, 2, 3)
  text = loaded.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], tokenize=False,
                                    add_generation_prompt=True)
  assert text == T.format_chat("What is 12 + 7?") == "<|user|> 12+  7<|assistant|>"
  ids = loaded.encode(text, add_special_tokens=False)
  assert ids == [4, 6, 23, 24, 17, 6, 6, 29, 5]
  assert loaded.decode(ids + [1, 2, 0], skip_special_tokens=True) == " 12+  7"


def test_chat_template_matches_format_chat(tmp_path):
  pytest.importorskip("jinja2")  # transformers needs it for apply_chat_template
  T.save_tokenizer(tmp_path)
  loaded = AutoTokenizer.from_pretrained(tmp_path)
  render = lambda messages, gen: loaded.apply_chat_template(messages, tokenize=False,
                                                            add_generation_prompt=gen)
  for question, _ in QUESTIONS:
    assert render([{"role": "user", "content": question}], True) == T.format_chat(question)
    assert render([{"role": "user", "content": question}, {"role": "assistant", "content": "42"}],
                  False) == T.format_chat(question, "42")
  # Both implementations agree on arbitrary mixtures of the pieces they rewrite.
  pieces = list("0123456789+-*x =?!.\n\t") + ["what is ", "What's ", "plus", "minus", "times", " X ",
                                              "f(", "\u00d7", "multiplied by", "\u00e9", "How much is",
                                              ",", ":", "123", "add:", "4567890123"]
  rng = random.Random(0)
  for k in range(600):
    q = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
    q = rng.choice(["sort ", "Sort:", "sort", "add:", "ADD:", "split ", "Split:"]) + q if k % 2 else q
    assert render([{"role": "user", "content": q}], True) == T.format_chat(q), repr(q)
