"""bench --server's load shapes, without a server: seeded Poisson arrivals and the loopback-only rule of
the open loop, and the flag checks."""
import numpy as np
import pytest

from dinfer_jax import cli
from dinfer_jax.bench import server
from dinfer_jax.bench.batching import workload


def test_poisson_arrivals_are_seeded_with_the_asked_mean_rate():
  a = server.arrival_times(20.0, 4000, seed=1)
  assert np.array_equal(a, server.arrival_times(20.0, 4000, seed=1))
  assert not np.array_equal(a, server.arrival_times(20.0, 4000, seed=2))
  gaps = np.diff(np.concatenate([[0.0], a]))
  assert np.all(gaps > 0) and abs(gaps.mean() - 1 / 20) < 0.005  # exponential gaps of mean 1/rate
  assert abs(np.std(gaps) / np.mean(gaps) - 1) < 0.1  # an exponential's coefficient of variation is 1


def test_open_loop_only_targets_loopback():
  with pytest.raises(ValueError, match="only targets loopback"):
    server.run("http://10.11.12.13:8000", ["x"], requests=1, rate=1.0)
  with pytest.raises(ValueError, match="either --concurrency"):
    server.run("http://127.0.0.1:1", ["x"], requests=1, rate=1.0, concurrency=2)


@pytest.mark.parametrize("argv,msg", [
    (["--arrival", "poisson"], "needs --rate > 0"),
    (["--arrival", "poisson", "--rate", "0"], "needs --rate > 0"),
    (["--rate", "3"], "--rate needs --arrival poisson"),
    (["--arrival", "poisson", "--rate", "3", "--concurrency", "4"], "exclude each other"),
])
def test_bench_server_flag_errors(argv, msg, capsys):
  assert cli.main(["bench", "--server", "http://127.0.0.1:1"] + argv) == 2
  assert msg in capsys.readouterr().err


def test_batching_workload_mixes_long_sums_and_short_questions():
  w = workload(200, seed=0)
  assert w == workload(200, seed=0)
  longs = [p for p in w if len(p) > 30]
  assert 70 < len(longs) < 130 and all(p.startswith("What is ") and " + " in p for p in longs)
