"""Paths and the OS: relative paths work from any working directory; a full disk is one line naming the path
with nothing left behind; a NaN/Inf weight is refused unless asked for (issue 24, item 4)."""
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ckpt_testlib import MODELS, arrays, copy_model, leftovers, load_config, write_hf
from dinfer_jax import checkpoint as ck

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)
  return env


def _convert(*args, cwd, prefix=()):
  return subprocess.run([*prefix, sys.executable, "-m", "convert", *map(str, args)], cwd=cwd, env=_env(),
                        capture_output=True, text=True, timeout=180)


def test_relative_paths_from_another_directory(tmp_path, monkeypatch):
  copy_model("llada", tmp_path / "src")
  # The CLI, run from the user's directory (not the repository) with relative SRC and DST.
  for args in (["hf2jax", "src", "out1"], ["inspect", "out1"], ["jax2hf", "out1", "hf_back"]):
    r = _convert(*args, cwd=tmp_path)
    assert r.returncode == 0, (args, r.stderr)
  assert "tensors" in _convert("inspect", "hf_back", cwd=tmp_path).stdout
  # The library too.
  monkeypatch.chdir(tmp_path)
  params, cfg, _ = ck.load_converted("out1")
  assert cfg.n_layers == load_config("llada")["n_layers"]
  assert ck.inspect("out1") == ck.inspect(tmp_path / "out1") != []
  back = arrays("hf_back")
  for k, v in arrays(MODELS["llada"]).items():
    np.testing.assert_array_equal(back[k].astype(np.float32), v.astype(np.float32).astype(back[k].dtype)
                                  .astype(np.float32), err_msg=k)


def _small_disk_prefix(mountpoint: pathlib.Path):
  """Runs the command with a 300 KB tmpfs at MOUNTPOINT (a private mount namespace; as root, or as a user
  through a user namespace)."""
  if shutil.which("unshare") is None:
    pytest.skip("unshare(1) not available")
  mountpoint.mkdir()
  userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
  probe = subprocess.run(["unshare", *userns, "--mount", "sh", "-c",
                          f"mount -t tmpfs -o size=300k tmpfs {mountpoint}"], capture_output=True)
  if probe.returncode != 0:
    pytest.skip(f"cannot mount a small tmpfs here: {probe.stderr.decode().strip()}")
  return ["unshare", *userns, "--mount", "sh", "-c", f'mount -t tmpfs -o size=300k tmpfs {mountpoint} && '
          f'"$@"; rc=$?; ls -A {mountpoint} > {mountpoint.parent}/left.txt; exit $rc', "sh"]


def test_disk_full_is_one_line_and_leaves_nothing(tmp_path):
  small = tmp_path / "small"
  prefix = _small_disk_prefix(small)
  # hf2jax: orbax's writer thread fails; no thread traceback, one line naming DST.
  r = _convert("hf2jax", MODELS["llada"], small / "out", "--dtype", "float32", cwd=tmp_path, prefix=prefix)
  assert r.returncode == 2, r.stderr
  assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
  assert str(small / "out") in r.stderr and "No space left on device" in r.stderr, r.stderr
  assert (tmp_path / "left.txt").read_text() == ""  # nothing half-written, seen from inside the namespace
  # jax2hf: an OSError from the safetensors writer, one line naming DST.
  assert _convert("hf2jax", MODELS["llada"], tmp_path / "j", "--dtype", "float32", cwd=tmp_path).returncode == 0
  r = _convert("jax2hf", tmp_path / "j", small / "hf", cwd=tmp_path, prefix=prefix)
  assert r.returncode == 2, r.stderr
  assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
  assert str(small / "hf") in r.stderr and "No space left on device" in r.stderr, r.stderr
  assert (tmp_path / "left.txt").read_text() == ""


@pytest.fixture
def nan_model(tmp_path):
  t = arrays(MODELS["llada"])
  key = next(k for k in sorted(t) if k.endswith("q_proj.weight"))
  t[key] = t[key].astype(np.float32).copy()
  t[key][0, 1] = np.nan
  t[key][2, 0] = np.inf
  t[key] = t[key].astype(arrays(MODELS["llada"])[key].dtype)
  return write_hf(tmp_path / "nan", t, load_config("llada")), key


def test_nonfinite_weight_is_refused_naming_the_tensor(nan_model, tmp_path):
  src, key = nan_model
  with pytest.raises(ck.CheckpointError, match=rf"tensor '{key}' in model.safetensors has 2 NaN/Inf value"):
    ck.hf2jax(src, tmp_path / "out")
  assert leftovers(tmp_path, "out") == []
  r = _convert("hf2jax", src, tmp_path / "out", cwd=tmp_path)
  assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and key in r.stderr, r.stderr
  assert "--allow-nonfinite" in r.stderr
  assert leftovers(tmp_path, "out") == []


def test_nonfinite_weight_converts_under_the_flag_with_a_warning(nan_model, tmp_path):
  src, key = nan_model
  with pytest.warns(UserWarning, match=key):
    ck.hf2jax(src, tmp_path / "out", dtype="float32", allow_nonfinite=True)
  r = _convert("hf2jax", src, tmp_path / "out2", "--allow-nonfinite", cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  assert key in r.stderr and "NaN/Inf" in r.stderr  # the warning reaches the user
  params, _, _ = ck.load_converted(tmp_path / "out")
  import jax
  bad = sum(int((~np.isfinite(np.asarray(x, np.float32))).sum()) for x in jax.tree.leaves(params))
  assert bad == 2  # converted as it was, not silently repaired
