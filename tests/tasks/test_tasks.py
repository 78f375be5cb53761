"""Task generation, verification and the train/test split."""
import collections
import dataclasses
import operator
import re

import numpy as np
import pytest

from dinfer_jax import tasks
from dinfer_jax.tasks import sandbox
from dinfer_jax.tasks import base

ARITH = tasks.get_task("arithmetic")
PROG = tasks.get_task("program")
SORT = tasks.get_task("sort")
ADD = tasks.get_task("add")
SPLIT = tasks.get_task("split")


def test_registry(monkeypatch):
  assert {"arithmetic", "program", "sort", "add", "split"} <= set(tasks.task_names())
  with pytest.raises(ValueError, match="name"):
    tasks.get_task("no-such-task")
  monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # keep the global registry clean

  class Echo(tasks.Task):
    name = "echo-test"

    def generate(self, rng):
      v = str(int(rng.integers(100)))
      return tasks.Problem(task=self.name, prompt=v, answer=v, split_keys=(v,))

    def check(self, problem, answer_text):
      return answer_text.strip() == problem.answer

  echo = tasks.register_task(Echo())
  assert tasks.get_task("echo-test") is echo
  with pytest.raises(ValueError, match="already registered"):
    tasks.register_task(Echo())
  tasks.register_task(Echo(), replace=True)
  probs = tasks.train_problems("echo-test", 5, seed=0)
  assert all(echo.check(p, p.answer) for p in probs)


def test_problem_validated():
  with pytest.raises(ValueError, match="prompt"):
    tasks.Problem(task="t", prompt="", answer="1", split_keys=("k",))
  with pytest.raises(ValueError, match="split_keys"):
    tasks.Problem(task="t", prompt="p", answer="1", split_keys=())
  with pytest.raises(ValueError, match="tests"):
    tasks.Problem(task="t", prompt="p", answer="1", split_keys=("k",), tests=((1, "2"),))
  with pytest.raises(ValueError, match="max_digits"):
    tasks.ArithmeticTask(max_digits=0)
  with pytest.raises(ValueError, match="ops"):
    tasks.ArithmeticTask(ops="+/")
  with pytest.raises(ValueError, match="max_multiplier_digits"):
    tasks.ArithmeticTask(max_multiplier_digits=4)
  with pytest.raises(ValueError, match="n_shown"):
    tasks.ProgramTask(n_shown=1)
  for kw, match in [(dict(digits=0), "digits"), (dict(min_len=1), "min_len"), (dict(max_len=65), "max_len"),
                    (dict(min_len=9, max_len=8), "min_len=9")]:
    with pytest.raises(ValueError, match=match):
      tasks.SortTask(**kw)
  for bad in [(1.0, 2.0), (1.0, 0.0, 1.0), (1.0, float("nan"), 1.0), [1.0, 1.0, 1.0]]:
    with pytest.raises(ValueError, match="op_weights"):
      tasks.ArithmeticTask(op_weights=bad)


@pytest.mark.parametrize("task", [ARITH, PROG, SORT, SPLIT], ids=lambda t: t.name)
def test_deterministic_for_a_seed(task):
  assert tasks.train_problems(task, 200, seed=3) == tasks.train_problems(task, 200, seed=3)
  assert tasks.train_problems(task, 200, seed=3) != tasks.train_problems(task, 200, seed=4)
  assert tasks.test_problems(task, 50, seed=1) == tasks.test_problems(task, 50, seed=1)
  rng_a, rng_b = np.random.default_rng(7), np.random.default_rng(7)
  assert [task.generate(rng_a) for _ in range(20)] == [task.generate(rng_b) for _ in range(20)]


_ARITH_PROMPT = re.compile(r" *([0-9]+)([-+*]) *([0-9]+)")


def test_arithmetic_problems_and_verifier():
  ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
  problems = tasks.train_problems(ARITH, 3000, seed=0)
  seen_ops, saw_carry, shapes = set(), False, set()
  for p in problems:
    a, op, b = _ARITH_PROMPT.fullmatch(p.prompt).groups()
    expected = ops[op](int(a), int(b))
    # Columns: operands right-aligned to 3 characters, the answer to 4.
    assert p.prompt == f"{a:>3}{op}{b:>3}" and p.answer == f"{expected:>4}"
    seen_ops.add(op)
    saw_carry |= op == "+" and (int(a) % 10 + int(b) % 10) >= 10
    assert expected >= 0  # allow_negative=False by default
    if op == "*":
      assert min(len(a), len(b)) == 1
      shapes.add((len(a), len(b)))
    assert ARITH.check(p, p.answer) and ARITH.check(p, p.answer.strip()) and ARITH.check(p, f"  {p.answer}\n")
    assert not ARITH.check(p, str(expected + 1))
  assert seen_ops == {"+", "-", "*"} and saw_carry
  assert shapes == {(1, 1), (1, 2), (2, 1), (1, 3), (3, 1)}
  assert len({p.prompt for p in problems}) > 2500
  negative = tasks.ArithmeticTask(ops="-", allow_negative=True)
  assert any(int(p.answer) < 0 for p in (negative.generate(np.random.default_rng(i)) for i in range(100)))


@pytest.mark.parametrize("answer", ["628", "", " ", "627.0", "+627", "627 0", "6 27", "1_627", "627\n1",
                                    "six hundred", "\u0666\u0662\u0667", "0x273", "9" * 100, None])
def test_arithmetic_rejects(answer):
  p = tasks.Problem(task="arithmetic", prompt="348+279", answer="627", split_keys=("+:279,348",))
  assert not ARITH.check(p, answer)
  assert ARITH.check(p, "627") and ARITH.check(p, "0627")


def test_op_weights_reweight_operators_not_the_split():
  def op_counts(task, n=4000):
    return collections.Counter(_ARITH_PROMPT.fullmatch(p.prompt).group(2) for p in
                               tasks.train_problems(task, n, seed=5))
  uniform = op_counts(ARITH)
  weighted_task = dataclasses.replace(ARITH, op_weights=(1.0, 1.0, 2.0))
  weighted = op_counts(weighted_task)
  assert all(abs(uniform[o] / 4000 - 1 / 3) < 0.03 for o in "+-*")
  assert abs(weighted["*"] / 4000 - 0.5) < 0.03 and abs(weighted["+"] / 4000 - 0.25) < 0.03
  # The held-out set is a property of the task name and problem key, not of the weights.
  rng = np.random.default_rng(0)
  drawn = [weighted_task.generate(rng) for _ in range(3000)]
  assert all(tasks.problem_split(weighted_task, p) == tasks.problem_split(ARITH, p) for p in drawn)
  held_out = {p.prompt for p in tasks.test_problems(ARITH, 300)}
  assert not held_out & {p.prompt for p in tasks.train_problems(weighted_task, 20000, seed=1)}


def test_no_negative_option():
  task = tasks.ArithmeticTask(ops="-", allow_negative=False)
  problems = [task.generate(np.random.default_rng(i)) for i in range(300)]
  assert all(int(p.answer) >= 0 for p in problems)


def test_program_problems_are_well_posed():
  table = tasks.canonical_functions()
  usable = tasks.canonical_functions(PROG.n_shown)
  # The family ranges are chosen so that 6 shown outputs identify every function.
  assert usable == table and len(table) > 2000
  assert max(len(expr) for expr in table) <= 8  # fits the 8-token answer region
  for p in tasks.train_problems(PROG, 500, seed=0):
    assert len(p.prompt) <= 31
    assert [x for x, _ in p.examples] == list(range(6)) and [x for x, _ in p.tests] == list(range(6, 20))
    assert p.prompt == "f(0..5)=" + ",".join(str(y) for _, y in p.examples)
    values = table[p.answer]
    assert all(values[x] == y for x, y in p.examples + p.tests)
    # The examples single out the reference among all functions of all families.
    matching = [e for e, v in table.items() if all(v[x] == y for x, y in p.examples)]
    assert matching == [p.answer]
  # With fewer shown inputs, functions the prompt cannot pin down are left out.
  few = tasks.canonical_functions(3)
  assert 0 < len(few) < len(table)
  for e, v in few.items():
    assert [o for o, w in table.items() if w[:3] == v[:3]] == [e]


def test_reference_expressions_agree_in_sandbox():
  # Every canonical answer, evaluated by the sandbox in one process, gives the generator's values.
  table = tasks.canonical_functions()
  code = ("exprs = %r\nfor e in exprs:\n  print(' '.join(str(eval(e, {'__builtins__': "
          "{'abs': abs, 'min': min, 'max': max}}, {'x': x})) for x in %r))") % (list(table),
                                                                                  list(tasks.DOMAIN))
  r = sandbox.run_python(code, limits=sandbox.Limits(max_output_bytes=1 << 20))
  assert r.ok, r
  got = [tuple(int(v) for v in line.split()) for line in r.stdout.splitlines()]
  assert got == list(table.values())


def test_program_verifier():
  problems = tasks.test_problems(PROG, 4, seed=0)
  for p in problems:
    assert PROG.check(p, p.answer)
    assert PROG.check(p, f" {p.answer} ")
  p = tasks.Problem(task="program", prompt="f(0..2)=2,5,8", answer="x*3+2", split_keys=("fn:x*3+2",),
                    examples=((0, 2), (1, 5), (2, 8)), tests=((4, 14), (7, 23), (19, 59)))
  assert PROG.check(p, "2+3*x")  # any spelling of the same function
  assert PROG.check(p, "(x+1)*3-1")
  # Fits the shown pairs only: must fail on the held-out ones.
  assert not PROG.check(p, "{0: 2, 1: 5, 2: 8}[x]")
  assert not PROG.check(p, "x*3+2 if x < 5 else 0")
  for wrong in ["x*3+1", "x*x", "hello", "", "import os", "__import__('os').getcwd()", "x*3+2.0", "x*3+"]:
    assert not PROG.check(p, wrong), wrong


@pytest.mark.parametrize("task,n_train,n_test", [(ARITH, 20000, 300), (PROG, 6000, 300), (SORT, 5000, 300),
                                                 (ADD, 5000, 300), (SPLIT, 5000, 150)],
                         ids=["arithmetic", "program", "sort", "add", "split"])
def test_train_and_test_are_disjoint(task, n_train, n_test):
  test = tasks.test_problems(task, n_test, seed=0)
  assert len({p.prompt for p in test}) == n_test
  assert all(tasks.problem_split(task, p) == "test" for p in test)
  test_keys = {k for p in test for k in p.split_keys}
  test_prompts = {p.prompt for p in test}
  for seed in (0, 1):
    train = tasks.train_problems(task, n_train, seed=seed)
    assert all(tasks.problem_split(task, p) == "train" for p in train)
    assert not test_prompts & {p.prompt for p in train}
    assert not test_keys & {k for p in train for k in p.split_keys}
  # The split does not depend on the sampling seed: other seeds' test sets are held out as well.
  other = tasks.test_problems(task, 100, seed=5)
  assert all(tasks.problem_split(task, p) == "test" for p in other)


def test_commuted_sum_stays_in_its_split():
  test = tasks.test_problems(ARITH, 300, seed=0)
  for p in test:
    a, op, b = _ARITH_PROMPT.fullmatch(p.prompt).groups()
    if op in "+*":
      swapped = tasks.Problem(task="arithmetic", prompt=f"{b:>3}{op}{a:>3}", answer=p.answer,
                              split_keys=p.split_keys)
      assert p.split_keys == (f"{op}:{min(int(a), int(b))},{max(int(a), int(b))}",)
      assert tasks.problem_split(ARITH, swapped) == "test"


def test_check_all():
  problems = tasks.test_problems("arithmetic", 3)
  assert tasks.check_all("arithmetic", problems, [p.answer for p in problems]) == [True] * 3
  with pytest.raises(ValueError, match="answers"):
    tasks.check_all("arithmetic", problems, [])


def test_sort_problems_and_verifier():
  seen_lengths = set()
  for p in tasks.train_problems(SORT, 500, seed=0) + tasks.test_problems(SORT, 100):
    assert p.prompt.startswith("sort:")
    values = p.prompt[len("sort:"):].split(",")
    assert all(len(v) == 1 and v.isdigit() for v in values)  # columns: every number 1 character wide
    assert p.answer == ",".join(sorted(values))
    assert p.split_keys == (f"sorted:{p.answer}",)
    assert 23 <= len(p.answer) <= 47 == SORT.answer_chars and len(p.prompt) <= SORT.prompt_chars
    seen_lengths.add(len(values))
    assert SORT.check(p, p.answer) and SORT.check(p, f" {p.answer} ")
    assert SORT.check(p, ",".join("0" + v for v in sorted(values)))  # zero padding is the same answer
  assert seen_lengths == set(range(12, 25))
  # The two-digit variant: zero-padded columns, which sort as strings like their integers.
  two = tasks.SortTask(digits=2, min_len=8, max_len=16)
  assert two.answer_chars == 47
  for p in tasks.train_problems(two, 200, seed=0):
    values = p.prompt[len("sort:"):].split(",")
    assert all(len(v) == 2 for v in values) and p.answer == ",".join(sorted(values))
    assert [int(v) for v in p.answer.split(",")] == sorted(int(v) for v in values)
    assert two.check(p, ",".join(str(int(v)) for v in sorted(values)))
  # A permutation that is not sorted, a dropped, extra or changed number, or any other text is wrong.
  p = tasks.Problem(task="sort", prompt="sort:42,07,93,07", answer="07,07,42,93", split_keys=("k",))
  for wrong in ["07,42,07,93", "07,42,93", "07,07,42,93,93", "07,07,42,94", "07 07 42 93", "7,7,42,93,",
                "", "07,07,42,-93", "0" * 300, None]:
    assert not SORT.check(p, wrong), wrong


def test_sort_split_holds_out_every_order_of_a_list():
  rng = np.random.default_rng(0)
  for p in tasks.test_problems(SORT, 100, seed=0):
    values = p.prompt[len("sort:"):].split(",")
    shuffled = tasks.Problem(task="sort", prompt="sort:" + ",".join(rng.permutation(values)), answer=p.answer,
                             split_keys=(f"sorted:{p.answer}",))
    assert tasks.problem_split(SORT, shuffled) == "test"


def test_long_addition_problems_and_verifier():
  for p in tasks.train_problems(ADD, 300, seed=0):
    assert p.prompt.startswith("add:") and len(p.prompt) == ADD.prompt_chars
    a, b = (int(x) for x in p.prompt[len("add:"):].split("+"))
    assert ADD.min_digits <= len(str(a)) <= ADD.max_digits and ADD.min_digits <= len(str(b)) <= ADD.max_digits
    assert len(p.answer) == ADD.answer_chars and int(p.answer) == a + b  # right-aligned in its columns
    assert p.split_keys == (f"pair:{min(a, b)}+{max(a, b)}",)
    assert ADD.check(p, p.answer) and ADD.check(p, str(a + b)) and ADD.check(p, f" {a + b}\n")
  p = tasks.Problem(task="add", prompt="add:" + "99".rjust(24) + "+" + "1".rjust(24), answer="100".rjust(25),
                    split_keys=("k",))
  for wrong in ["101", "10 0", "0100x", "", "-100", "1" * 200, "\u0661\u0660\u0660", None]:
    assert not ADD.check(p, wrong), wrong
  assert ADD.check(p, "0100")  # leading zeros are the same number
  with pytest.raises(ValueError, match="min_digits"):
    type(ADD)(min_digits=30)


def test_long_addition_split_holds_out_both_orders():
  for p in tasks.test_problems(ADD, 100, seed=0):
    a, b = p.prompt[len("add:"):].split("+")
    swapped = tasks.Problem(task="add", prompt=ADD.write(int(b), int(a)), answer=p.answer, split_keys=p.split_keys)
    assert tasks.problem_split(ADD, swapped) == "test"


def test_split_problems_and_verifier():
  answers = {}
  for p in tasks.train_problems(SPLIT, 3000, seed=0):
    n = int(p.prompt[len("split:"):])
    assert p.prompt == f"split:{n:>3}" and 0 <= n <= 999 and p.split_keys == (f"n:{n}",)
    assert len(p.answer) == SPLIT.answer_chars and p.answer[3] == "+"  # both addends in 3 columns
    a, b = (int(x) for x in p.answer.split("+"))
    assert a + b == n and a >= 0 and b >= 0 and SPLIT.check(p, p.answer)
    # column by column, no carries: the digits of each column add up to N's digit there
    assert [int(x) + int(y) for x, y in zip(p.answer[:3], p.answer[4:])] == [int(c) for c in f"{n:03d}"]
    answers.setdefault(n, set()).add(a)
  # Many right answers per prompt: the first addend is spread over 0..N, not a function of N.
  assert max(len(v) for v in answers.values()) >= 5
  p = tasks.Problem(task="split", prompt="split: 73", answer="070+003", split_keys=("n:73",))
  for right in ["70+3", " 0+73", "73+0", "36 + 37", "073+000\n"]:
    assert SPLIT.check(p, right), right
  for wrong in ["70+4", "73", "70-3", "+73", "-1+74", "7 0+3", "", "1" * 100, "\u0667\u0660+3", None, "70+3+0"]:
    assert not SPLIT.check(p, wrong), wrong
  with pytest.raises(ValueError, match="digits"):
    tasks.SplitTask(digits=0)


@pytest.mark.parametrize("name", ["arithmetic", "program", "add", "sort", "split"])
def test_every_task_accepts_its_own_problems(name):
  t = tasks.get_task(name)
  rng = np.random.default_rng(3)
  assert all(t.accepts(t.generate(rng).prompt) for _ in range(300))


@pytest.mark.parametrize("prompt, task", [
    (" 61*  7", "arithmetic"), ("348+279", "arithmetic"), ("  9-  5", "arithmetic"),
    (" 12* 13", None),  # two-digit multiplier: trained on one digit only
    ("  5-  9", None),  # negative result: never trained
    ("12+3", None), ("1234+  5", None),  # not the column format the chat template writes
    ("f(0..5)=2,5,8,11,14,17", "program"), ("f(0..3)=1,2,3,4", None),
    ("add:" + f"{123456789:>24}+{987654321:>24}", "add"), ("add:" + f"{12345:>24}+{678:>24}", None),
    ("sort:3,1,2", None),  # the default model's mix has no sort
    ("Hello, who are you?", None), ("", None),
])
def test_trained_task_of_the_default_models_mix(prompt, task):
  assert tasks.trained_task_of(["arithmetic", "program", "add"], prompt) == task
