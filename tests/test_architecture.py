"""The house drawn from the imports: no circles, the library never imports the trainer, and function-local
imports only for optional extras (never to hide a circle)."""
from __future__ import annotations

import ast
import collections
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("dinfer_jax", "train_td", "convert")
# Third-party packages of the optional extras (serve, eval, cuda, td, plot) and the heavy tokenizer stack a model
# without a tokenizer never needs: imported where used, so the base install runs without them.
EXTRAS = ("fastapi", "uvicorn", "starlette", "pydantic", "lm_eval", "jax_plugins", "tokamax", "triton", "pyarrow",
          "matplotlib", "transformers", "torch")
# Library modules that import an extra at module level: imported where used, as the extra itself.
EXTRA_MODULES = ("dinfer_jax.serve.app", "dinfer_jax.serve.protocol", "dinfer_jax.evaluation.lm_eval_model")
# The sandbox's launcher runs this file as a script inside the namespaces it builds: it imports each stdlib
# module where the launcher needs it (before and after pivoting into the program's root).
LAUNCHER = "dinfer_jax.tasks.sandbox"


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for pkg in PACKAGES:
    for f in (ROOT / pkg).rglob("*.py"):
      parts = list(f.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = f
  return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
  """The project module an import name refers to (a.b.attr -> a.b), or None for another package's."""
  while name:
    if name in MODULES:
      return name
    name = name.rpartition(".")[0]
  return None


def _imports() -> list[tuple[str, str, bool, int]]:
  """(module, imported name, inside a function, line) of every import statement in the project."""
  out = []
  for mod, path in MODULES.items():
    is_pkg = path.name == "__init__.py"

    def visit(node, in_fn):
      for ch in ast.iter_child_nodes(node):
        fn = in_fn or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(ch, ast.Import):
          out.extend((mod, a.name, in_fn, ch.lineno) for a in ch.names)
        elif isinstance(ch, ast.ImportFrom):
          base = ch.module or ""
          if ch.level:
            pkg = (mod.split(".") if is_pkg else mod.split(".")[:-1])[:len(mod.split(".")) - ch.level + is_pkg]
            base = ".".join(pkg + ([base] if base else []))
          # `from pkg import sub` names the submodule when there is one, else the package's attribute.
          out.extend((mod, f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, in_fn, ch.lineno)
                     for a in ch.names)
        visit(ch, fn)
    visit(ast.parse(path.read_text()), False)
  return out


IMPORTS = _imports()


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in edges[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))
  for v in list(edges):
    if v not in index:
      visit(v)
  return out


def test_no_import_circles_even_through_function_local_imports():
  edges = collections.defaultdict(set)
  for mod, name, _, _ in IMPORTS:
    target = _resolve(name)
    if target is not None and target != mod:
      edges[mod].add(target)
  for m in MODULES:
    edges[m]
  assert _cycles(edges) == []
  assert len(edges) > 100  # the graph is the project's, not an empty one


def test_the_library_never_imports_the_trainer():
  arrows = [(m, n, line) for m, n, _, line in IMPORTS
            if m.startswith("dinfer_jax") and (n == "train_td" or n.startswith("train_td."))]
  assert arrows == []
  # ... while the trainer does use the library (the arrow runs one way).
  assert any(m.startswith("train_td") and n.startswith("dinfer_jax") for m, n, _, _ in IMPORTS)


def test_function_local_imports_are_only_optional_extras():
  def extra(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in EXTRAS + EXTRA_MODULES)
  local = [(m, n, line) for m, n, in_fn, line in IMPORTS if in_fn and m != LAUNCHER and not extra(n)]
  assert local == []


@pytest.mark.parametrize("blocked,modules", [
    # A base install (no serve, eval, cuda, td or plot extra) runs every command line: none of the extras is
    # imported on the way.
    (tuple(e for e in EXTRAS if e != "transformers"),
     "dinfer_jax, dinfer_jax.cli, dinfer_jax.engine.generate, dinfer_jax.serve.cli, dinfer_jax.bench.cli, "
     "dinfer_jax.evaluation.cli, train_td.__main__"),
    # The library reaches the tokenizer stack only for a model that has a tokenizer (hf_quiet).
    (EXTRAS, "dinfer_jax, dinfer_jax.cli, dinfer_jax.engine.generate, dinfer_jax.serve.cli, dinfer_jax.bench.cli"),
], ids=["extras", "tokenizer stack"])
def test_the_command_lines_import_without_the_extras(blocked, modules):
  code = ("import sys\n"
          f"for name in {blocked!r}:\n"
          "  sys.modules[name] = None  # importing it raises ImportError\n"
          f"import {modules}\n"
          "print('ok')\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("path", ["dinfer_jax/engine", "dinfer_jax/decoders"])
def test_engine_functions_are_short(path):
  """The loop reads phase -> policy forward -> decode -> smoothing -> commit: no function of the engine or the
  decoders runs past about 60 lines (docstrings included)."""
  long = []
  for f in (ROOT / path).rglob("*.py"):
    for node in ast.walk(ast.parse(f.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 65:
        long.append((f.name, node.name, node.end_lineno - node.lineno + 1))
  assert long == []
