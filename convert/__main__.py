"""`python -m convert ...`: kept for existing scripts; the CLI lives in dinfer_jax.checkpoint.cli."""
import sys

from dinfer_jax.checkpoint.cli import main

if __name__ == "__main__":
  sys.exit(main(prog="python -m convert"))
