"""Two CPU processes on loopback (4 fake devices each, jax.distributed) give the single-process results.

`dinfer-jax generate` splits the batch rows across the processes (the data axis spans both); `train_td
train` runs data parallel x model sharded across them and checkpoints through orbax from both; `train_td
collect` gives each process a share of the batches, written as its own shards.
"""
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from dinfer_jax import cli
from tests.engine.golden import MODEL_DIRS

ROOT = pathlib.Path(__file__).resolve().parents[2]
GEN_ARGS = ["generate", "5,6,7,8,9", "10,11,12", "3,4,5,6,7,8,9", "1,2", "--model", str(MODEL_DIRS["A"]),
            "--gen-length", "16", "--block-length", "8", "--cache", "dual", "--threshold", "0.85",
            "--prefix-look", "4", "--after-look", "4", "--warmup-steps", "2", "--show-steps"]
TRAIN_ARGS = ["--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--n-experts", "4", "--n-experts-per-tok",
              "2", "--expert-ffn-dim", "32", "--batch-size", "8", "--steps", "2", "--warmup-steps", "0",
              "--log-every", "1", "--ckpt-every", "2", "--no-progress"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_processes(module: str, args: list[str], timeout: int = 600) -> list[str]:
  """Runs `python -m module args` as processes 0 and 1 of one jax.distributed job; returns their stdouts."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
             PYTHONPATH=str(ROOT))
  coord = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen([sys.executable, "-m", module, *args, "--coordinator", coord, "--num-processes", "2",
                             "--process-id", str(i)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout)
      assert p.returncode == 0, err[-3000:]
      outs.append(out)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return outs


def test_generate_on_two_processes_equals_one(capsys):
  assert cli.main(GEN_ARGS) == 0
  single = capsys.readouterr().out
  assert "### 1,2" in single
  p0, p1 = _two_processes("dinfer_jax.cli", GEN_ARGS + ["--mesh", "data=4,tensor=2"])
  # Gloo (the CPU collectives) reports its connections on stdout from C++ threads, interleaved, while the
  # processes connect (before the result is gathered); our output starts at the first prompt header.
  assert "### " in p0 and "### " not in p1
  assert p0[p0.index("### "):] == single  # tokens and every step's commits (--show-steps), from process 0


@pytest.mark.slow
def test_train_on_two_processes_equals_one(tmp_path):
  from train_td import __main__ as train_main
  from train_td import trainer
  assert train_main.main(["train", str(tmp_path / "one"), *TRAIN_ARGS]) == 0
  _two_processes("train_td", ["train", str(tmp_path / "two"), *TRAIN_ARGS, "--mesh", "data=2,tensor=2,expert=2"])
  a, _, sa = trainer.restore(tmp_path / "one")
  b, _, sb = trainer.restore(tmp_path / "two")
  assert sa == sb == 2
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert np.abs(x - y).max() <= 1e-5 * np.abs(x).max(), jax.tree_util.keystr(path)


@pytest.mark.parametrize("argv,msg", [
    (["--mesh", "data=2,pipeline=4"], "--mesh: bad item 'pipeline=4'"),
    (["--mesh", "tensor=0"], "--mesh: bad item 'tensor=0'"),
    (["--coordinator", "127.0.0.1:1"], "--coordinator needs --num-processes and --process-id"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id 2 is outside [0, --num-processes=2)"),
    (["--process-id", "1"], "--num-processes/--process-id need --coordinator"),
    (["--coordinator", "auto", "--num-processes", "2"], "--coordinator auto takes the process count and id from"),
    (["--mesh", "data=16"], "16 devices requested, only 8 available"),
])
def test_parallel_flags_fail_with_one_line(argv, msg, capsys):
  if len(jax.devices()) != 8:
    pytest.skip("the device count in the message assumes 8 fake devices")
  assert cli.main(GEN_ARGS[:2] + ["--model", str(MODEL_DIRS["A"])] + argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and msg in err and "\n" not in err, err


@pytest.mark.slow  # over 20 s on 2 cores: -m slow
def test_collect_on_two_processes_equals_one(tmp_path):
  from train_td import __main__ as td_main
  from train_td import td_data
  args = ["collect", "--model", "default", "--task", "arithmetic", "--n", "12", "--batch", "4", "--no-progress"]
  assert td_main.main(args + ["--out", str(tmp_path / "one")]) == 0
  _two_processes("train_td", args + ["--out", str(tmp_path / "two")])
  shards = sorted(p.name for p in (tmp_path / "two").glob("*.parquet"))
  assert {n.split("-")[1] for n in shards} == {"000", "001"}, shards  # each process wrote its own shards
  one, two = td_data.read_records(tmp_path / "one"), td_data.read_records(tmp_path / "two")
  order = lambda rec: sorted(range(len(rec["index"])), key=lambda i: rec["index"][i])  # noqa: E731
  assert len(one["index"]) > 0
  for c in td_data.COLUMNS:
    assert [one[c][i] for i in order(one)] == [two[c][i] for i in order(two)], c


def test_coordinator_auto_lets_the_cluster_name_the_peers(monkeypatch):
  """`--coordinator auto` (the same command on every host of a TPU slice): jax.distributed is started with no
  addresses, so it reads them from the cluster (a Cloud TPU VM's metadata, SLURM, Open MPI)."""
  import argparse

  from dinfer_jax import sharding
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  args = argparse.Namespace(coordinator="auto", num_processes=None, process_id=None, mesh=None)
  assert sharding.setup_parallel(args) is None and calls == [((), {})]
