"""Installs the wheels of a folder into a target folder, skipping every distribution the running Python
already has (the GPU machine's own jax, numpy, ... stay in charge). No registry, no dependency resolution:
gpu_prep.sh downloaded exactly what is needed.

python3 dinfer_jax/bench/box_install.py WHEEL_DIR TARGET_DIR
"""
from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys


def dist_name(wheel: pathlib.Path) -> str:
  return wheel.name.split("-")[0].replace("_", "-").lower()


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    raise SystemExit("usage: box_install.py WHEEL_DIR TARGET_DIR")
  src, target = pathlib.Path(argv[0]), pathlib.Path(argv[1])
  wheels = sorted(src.glob("*.whl"))
  if not wheels:
    raise SystemExit(f"box_install: no wheels in {src}")
  sys.path.insert(0, str(target))  # what an earlier run installed there counts as present
  importlib.invalidate_caches()
  todo, kept = [], []
  for w in wheels:
    try:
      kept.append(f"{dist_name(w)} {importlib.metadata.version(dist_name(w))}")
    except importlib.metadata.PackageNotFoundError:
      todo.append(w)
  if kept:
    print("box_install: present, kept:", ", ".join(kept))
  if todo:
    print("box_install: installing", ", ".join(w.name for w in todo), "into", target, flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(target), *map(str, todo)], check=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
