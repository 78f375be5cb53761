"""Every name in conftest.SLOW_CASES is a test that exists: a test whose file moved would otherwise drop out of
the list and come back to the default run unnoticed (two did, adding 33 s)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent


def _slow_cases() -> tuple[str, ...]:
  """conftest.SLOW_CASES, read from the file (importing conftest again would redo its jax setup)."""
  tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
  node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SLOW_CASES")
  return ast.literal_eval(node.value)


def test_every_slow_case_names_an_existing_test():
  missing = []
  cases = _slow_cases()
  assert len(cases) > 40
  for nodeid in cases:
    path, _, name = nodeid.partition("::")
    fn = name.split("[")[0]
    file = ROOT / path
    if not file.is_file():
      missing.append(f"{nodeid}: no file {path}")
      continue
    defs = {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}
    if fn not in defs:
      missing.append(f"{nodeid}: no test {fn} in {path}")
  assert not missing, "\n".join(missing)
