"""Ctrl-C and SIGTERM, sent at several points of `generate`, `serve` and training, end each command with one
line and exit 130 / 143 (the server: a graceful shutdown, exit 0), never a traceback, an abort from C++ or a
segfault. A taken port is a one-line error before anything else. Each case is a real process, as a user's."""
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

CRASH_SIGNS = ("Traceback", "terminate called", "FATAL", "Segmentation fault", "core dumped")


def _start(argv: list[str], log, module: str = "dinfer_jax.cli") -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", module, *argv], stdout=subprocess.DEVNULL, stderr=log,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), text=True)


def _wait_for(proc: subprocess.Popen, log_path, pattern: str, timeout: float = 120) -> str:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    text = log_path.read_text(errors="replace")
    if re.search(pattern, text):
      return text
    assert proc.poll() is None, f"exited {proc.returncode} before {pattern!r}: {text[-2000:]}"
    time.sleep(0.05)
  proc.kill()
  raise AssertionError(f"no {pattern!r} within {timeout} s: {log_path.read_text()[-2000:]}")


def _stopped(proc: subprocess.Popen, log_path, sig: int) -> tuple[int, str, list[str]]:
  proc.send_signal(sig)
  try:
    rc = proc.wait(60)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise
  text = log_path.read_text(errors="replace")
  lines = [ln.strip() for ln in re.split(r"[\r\n]", text) if ln.strip()]
  assert not any(s in text for s in CRASH_SIGNS), text[-3000:]
  return rc, text, lines


@pytest.mark.parametrize("point,sig,code", [("compile", signal.SIGINT, 130), ("run", signal.SIGTERM, 143)])
def test_generate_stops_in_one_line(tmp_path, point, sig, code):
  """Before: about 100 lines ending in JaxStackTraceBeforeTransformation during the compile, 10 ending in
  sharding.to_host during the run."""
  prompts = tmp_path / "many.txt"
  prompts.write_text("".join(f"What is {i}+{i * 7 % 1000}?\n" for i in range(4000)))
  log_path = tmp_path / "err.txt"
  with open(log_path, "w") as log:
    proc = _start(["generate", "-f", str(prompts), "--compile-cache", "off"], log)
    # The bar appears at 0/N while the first batch's program compiles; a count above 0 means it runs.
    _wait_for(proc, log_path, r" 0/4000 \[" if point == "compile" else r" [1-9]\d*/4000 \[")
    rc, _, lines = _stopped(proc, log_path, sig)
  assert rc == code and lines[-1] == f"dinfer-jax generate: {'interrupted' if code == 130 else 'terminated'}", lines[-3:]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_serve_shuts_down_with_a_stream_open_and_exits_0(tmp_path):
  """Before: 2 of 3 Ctrl-C stops after a streaming request aborted from C++ (exit 134). The warm-up compiles
  in the background meanwhile (its thread is inside XLA when the signal comes)."""
  port = _free_port()
  log_path = tmp_path / "err.txt"
  with open(log_path, "w") as log:
    proc = _start(["serve", "--port", str(port), "--compile-cache", "off"], log)
    _wait_for(proc, log_path, r"on http://")
    deadline = time.monotonic() + 120
    while True:
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
          break
      except OSError:
        assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()[-2000:]
        time.sleep(0.2)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", json.dumps({"model": "default", "prompt": "What is 348+279?",
                                                      "stream": True, "max_tokens": 64}),
              {"Content-Type": "application/json"})
    assert c.getresponse().status == 200
    rc, _, lines = _stopped(proc, log_path, signal.SIGINT)
  assert rc == 0 and lines[-1] == "dinfer-jax serve: shut down on a signal", lines[-3:]


def test_serve_on_a_taken_port_is_one_line_before_anything_else(tmp_path):
  """Before: it printed the model's URL, then [Errno 98], then aborted from C++ (exit 134)."""
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "dinfer_jax.cli", "serve", "--port", str(port)], capture_output=True,
                       text=True, timeout=120)
  assert r.returncode == 2 and r.stdout == "", r
  assert r.stderr.strip().splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use "
                                           "(--port picks another)"], r.stderr


def test_training_stops_in_one_line_without_a_segfault(tmp_path):
  """Before: a traceback, then `Segmentation fault` (exit 139) as the interpreter exited around JAX's threads."""
  log_path = tmp_path / "err.txt"
  run = tmp_path / "run"
  with open(log_path, "w") as log:
    proc = _start(["train", str(run), "--steps", "100000", "--log-every", "1", "--ckpt-every", "100000",
                   "--no-progress"], log, module="train_td")
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
      assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()[-2000:]
      time.sleep(0.1)
    rc, _, lines = _stopped(proc, log_path, signal.SIGINT)
  assert rc == 130 and lines[-1] == "python -m train_td train: interrupted", lines[-3:]
