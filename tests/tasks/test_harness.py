"""The code verifier's harness: honest programs keep their verdicts, and no trick of the program passes.

The tricks are wrong solutions of `add(a, b)` (they return a - b, or nothing useful) that try to pass
anyway; each must fail. Hand-worked splits check what runs where.
"""
import os
import pathlib
import uuid

import pytest

from dinfer_jax.tasks import harness, sandbox

pytestmark = pytest.mark.skipif(not sandbox.available_modes(), reason="no sandbox on this machine")

TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, 20) == 30"]
RIGHT = "def add(a, b):\n  return a + b\n"
WRONG = "def add(a, b):\n  return a - b\n"
LIMITS = sandbox.Limits(cpu_seconds=2, wall_seconds=5.0, max_output_bytes=1 << 20)


def check(program, tests=TESTS, setup=""):
  return harness.check_tests(program, tests, setup, limits=LIMITS)


def test_split_by_hand():
  s = harness.split_tests(["assert add(2, 3) == 5", "assert math.isclose(area(2), 12.56, rel_tol=1e-3)",
                           "assert set(f([1, 2])) == {1, 2} and not g(0)",
                           "assert sorted(x for x in range(3)) == [0, 1, 2]",
                           "assert [h(i) for i in range(2)] == [1, 2]"], "import math")
  assert s.verdict_exprs[0] == "__probe(0) == 5"
  assert s.verdict_exprs[1] == "math.isclose(__probe(1), 12.56, rel_tol=0.001)"
  assert s.verdict_exprs[2] == "set(__probe(2)) == {1, 2} and (not __probe(3))"
  assert s.verdict_exprs[3] == "sorted((x for x in range(3))) == [0, 1, 2]"  # no program name: no probe
  assert s.verdict_exprs[4] == "[(lambda __row: __val(__row[0]))(__next_row(4)) for i in range(2)] == [1, 2]"
  assert s.probe_exprs == ("__cap(lambda: add(2, 3))", "__cap(lambda: area(2))", "__cap(lambda: f([1, 2]))",
                           "__cap(lambda: g(0))", "__rows(lambda: [(__cap(lambda: h(i)),) for i in range(2)])")
  # The expected values never reach the probe run.
  assert not any("12.56" in p or "== 5" in p for p in s.probe_exprs)


@pytest.mark.parametrize("test,why", [
    ("x = add(1, 2)", "must be one assert"), ("assert add(1, 2) == 3; assert True", "must be one assert"),
    ("assert (y := add(1, 2)) == 3", "namedexpr"), ("assert sorted([2, 1], key=lambda x: add(x, 0)) == [1, 2]", "lambda"),
    ("assert all(x > 0 for x in add(1, 2))", "iterates over"), ("assert add(", "not valid Python")])
def test_unverifiable_tests_refused(test, why):
  with pytest.raises(harness.UnverifiableTest, match=why):
    harness.split_tests([test])


def test_honest_verdicts():
  assert check(RIGHT).passed and check(RIGHT).results == (True, True, True)
  r = check("def add(a, b):\n  return 5\n")
  assert not r.passed and r.results == (True, False, False) and r.reason == "failed"
  assert not check(WRONG).passed
  loop = check("def add(a, b):\n  while True:\n    pass\n")
  assert not loop.passed
  syntax = check("def add(a, b)\n  return a + b\n")
  assert not syntax.passed and syntax.reason == "no_report"
  assert not check("raise ValueError('no')\n" + RIGHT).passed
  # Rich but honest results: floats, tuples, dicts, sets, generators, namedtuples, Counters, bool subclass.
  rich = ["assert math.isclose(avg([1, 2]), 1.5)", "assert pairs(2) == [(0, 1), (1, 2)]",
          "assert count('aab') == {'a': 2, 'b': 1}", "assert list(evens(5)) == [0, 2, 4]",
          "assert point(1, 2) == (1, 2)", "assert {k: sq(k) for k in range(3)} == {0: 0, 1: 1, 2: 4}",
          "assert all(sq(i) == i * i for i in range(4))", "assert not is_odd(2)", "assert uniq([1, 1]) == {1}"]
  prog = ("import collections\ndef avg(x): return sum(x) / len(x)\ndef pairs(n): return [(i, i + 1) for i in range(n)]\n"
          "def count(s): return collections.Counter(s)\ndef evens(n): return (i for i in range(n) if i % 2 == 0)\n"
          "P = collections.namedtuple('P', 'x y')\ndef point(x, y): return P(x, y)\ndef sq(k): return k * k\n"
          "def is_odd(n): return n % 2 == 1\ndef uniq(x): return set(x)\n")
  r = check(prog, rich, "import math")
  assert r.passed, r


# Each trick is a wrong add (a - b) that tries to pass anyway.
TRICKS = {
    "sys_exit_before_asserts": WRONG + "import sys\nsys.exit(0)\n",
    "os_exit_before_asserts": WRONG + "import os\nos._exit(0)\n",
    "eq_always_true": "class A:\n  def __eq__(self, o): return True\n  def __bool__(self): return True\n"
                      "def add(a, b):\n  return A()\n",
    "atexit_os_exit": WRONG + "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    "del_os_exit": "import os\nclass D:\n  def __del__(self): os._exit(0)\ndef add(a, b):\n  D()\n  return a - b\n",
    # -- more tricks
    "int_subclass_eq": "class I(int):\n  def __eq__(self, o): return True\n  __hash__ = int.__hash__\n"
                       "def add(a, b):\n  return I(a - b)\n",
    "str_subclass_eq": "class S(str):\n  def __eq__(self, o): return True\ndef add(a, b):\n  return S('x')\n",
    "list_subclass_iter": "class L(list):\n  def __eq__(self, o): return True\n  def __iter__(self): return iter([5])\n"
                          "def add(a, b):\n  return L()\n",
    "exit_inside_function": "import sys\ndef add(a, b):\n  sys.exit(0)\n",
    "os_exit_inside_function": "import os\ndef add(a, b):\n  os._exit(0)\n",
    "kill_self": "import os, signal\ndef add(a, b):\n  os.kill(os.getpid(), signal.SIGKILL)\n",
    "close_stdout": WRONG + "import os\nos.close(1)\n",
    "print_fake_ok": WRONG + "print('OK: 3 passed')\nprint('#dinfer-harness-' + '0' * 32 + '#[true, true, true]')\n",
    "patch_builtins": WRONG + "import builtins\nbuiltins.AssertionError = SystemExit\n"
                      "builtins.isinstance = lambda *a: True\nbuiltins.bool = lambda *a: True\n",
    "patch_json": WRONG + "import json\njson.dumps = lambda *a, **k: '[[\"b\", true], [\"b\", true], [\"b\", true]]'\n",
    "excepthook_exit0": WRONG + "import sys, os\nsys.excepthook = lambda *a: os._exit(0)\n",
    "thread_exits_later": WRONG + "import threading, os, time\n"
                          "threading.Thread(target=lambda: (time.sleep(0.5), os._exit(0)), daemon=True).start()\n",
    "reads_its_own_file": ("import re\nsrc = open('/tmp/main.py').read()\nwant = re.findall(r'== (-?\\d+)', src)\n"
                           "_answers = iter(int(w) for w in want)\ndef add(a, b):\n  return next(_answers, a - b)\n"),
    "forged_record": ("import re, os, json\nsrc = open('/tmp/main.py').read()\nnonce = re.search(r\"'(#dinfer-harness-\\w+#)'\", src).group(1)\n"
                      "os.write(1, ('\\n' + nonce + json.dumps([['b', True]] * 3) + '\\n').encode())\nos._exit(0)\n"),
    "generator_object": "def add(a, b):\n  yield a - b\n",
    "truthy_custom_for_truthiness": "class T:\n  def __bool__(self): return True\ndef add(a, b):\n  return T()\n",
    "none_result": "def add(a, b):\n  pass\n",
}


@pytest.mark.parametrize("name", sorted(TRICKS))
def test_tricks_fail(name):
  tests = TESTS + (["assert is_pos(1)"] if name == "truthy_custom_for_truthiness" else [])
  prog = TRICKS[name] + ("def is_pos(x):\n  return add(x, 0)\n" if name == "truthy_custom_for_truthiness" else "")
  r = check(prog, tests)
  assert not r.passed, (name, r)
  assert r.results != (True,) * len(tests)


def test_the_old_single_run_was_fooled_and_the_harness_is_not():
  # What the old verifier did: program + asserts in one run, pass = exit 0. The same tricks pass there.
  for name in ("sys_exit_before_asserts", "os_exit_before_asserts", "eq_always_true", "atexit_os_exit",
               "del_os_exit"):
    old = sandbox.run_python("\n".join([TRICKS[name], *TESTS]), limits=LIMITS)
    assert old.ok, name
    assert not check(TRICKS[name]).passed, name


def test_mbpp_scoring_uses_the_harness_and_the_sandbox(tmp_path, monkeypatch):
  from dinfer_jax.evaluation.tasks import mbpp_utils
  secret = "s3cret-" + uuid.uuid4().hex
  monkeypatch.setenv("DINFER_MBPP_SECRET", secret)
  leak = tmp_path / "leak.txt"
  prog = RIGHT + (f"import os\ntry:\n  open({str(leak)!r}, 'w').write(os.environ.get('DINFER_MBPP_SECRET', 'none'))\n"
                  "except OSError:\n  pass\n")
  assert mbpp_utils.passes(prog, "", TESTS)
  assert not leak.exists()
  assert not mbpp_utils.passes(TRICKS["sys_exit_before_asserts"], "", TESTS)
  assert not mbpp_utils.passes(TRICKS["eq_always_true"], "", TESTS)


@pytest.mark.parametrize("tests,setup", [(["assert max([1, 5, 3]) == 5"], ""), (["assert 1 + 1 == 2"], ""),
                                         (["assert gcd(12, 18) == 6"], "from math import *"),
                                         (["assert round(2.675, 2) == 2.67"], "")])
def test_tests_that_pass_without_the_program_are_refused(tests, setup):
  """A test set whose names are all builtins or the setup's passes the empty answer: it is refused (MBPP
  scores it a failure, a JSONL task refuses the record), and an empty answer never passes."""
  from dinfer_jax.evaluation.tasks import mbpp_utils
  with pytest.raises(harness.UnverifiableTest, match="no test uses a name the program defines"):
    harness.split_tests(tests, setup)
  with pytest.warns(UserWarning, match="cannot verify"):
    assert mbpp_utils.process_results({"test_list": tests, "test_imports": [setup] if setup else []}, [""]) == {
        "pass_at_1": 0.0}


def test_programs_the_sandbox_cannot_take_fail():
  for program in (RIGHT + "# \ud800", RIGHT + "#" * (LIMITS.disk_bytes // 2)):
    r = check(program)
    assert (r.passed, r.reason, r.results) == (False, "unrunnable", (False,) * 3)
