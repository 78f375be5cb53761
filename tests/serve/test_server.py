"""dinfer-jax serve as a subprocess on loopback: the openai client unchanged (chat, completion, stop,
streaming), 64 concurrent clients each getting its single-request answer, OpenAI-style 4xx errors that
leave the server serving, and `dinfer-jax bench --server`."""
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import dinfer_jax  # noqa: E402
from dinfer_jax import cli, cli_common  # noqa: E402

QUESTIONS = ["What is 348+279?", "12 x 13", "f(0..5)=2,5,8,11,14,17", "905-417", "61*7", "f(0..5)=1,3,5,7,9,11",
             "What is 7 + 8?", "f(0..5)=0,2,4,6,8,10", "999-1", "What is 25 times 4?", "3+4", "f(0..5)=9,8,7,6,5,4"]
MAX_BATCH = 4


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  port = _free_port()
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  proc = subprocess.Popen(
      [sys.executable, "-m", "dinfer_jax.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
       "--max-batch", str(MAX_BATCH), "--batch-window-ms", "20", "--warmup-max-prompt-len", "32",
       "--timeout-s", "60", "--compile-cache", str(tmp_path_factory.mktemp("xla"))], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
  base = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 240
  try:
    while True:
      if proc.poll() is not None:
        pytest.fail(f"server exited: {proc.stdout.read()[-2000:]}")
      try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
          if json.loads(r.read())["status"] == "ok":
            break
      except (urllib.error.URLError, OSError):
        pass
      if time.monotonic() > deadline:
        pytest.fail("server did not become healthy within 240 s")
      time.sleep(0.5)
    yield base
  finally:
    proc.terminate()
    try:
      proc.wait(20)
    except subprocess.TimeoutExpired:
      proc.kill()


@pytest.fixture(scope="module")
def model(default_model):
  return default_model


@pytest.fixture(scope="module")
def alone(model, default_gcfg):
  """Each question's answer run alone through dinfer_jax.generate, decoded as the server decodes."""
  gcfg = default_gcfg
  ids = cli_common.encode_prompts(model, QUESTIONS)
  return {q: model.tokenizer.decode(dinfer_jax.generate(model, [p], gcfg).tokens[0], skip_special_tokens=True)
          for q, p in zip(QUESTIONS, ids)}


@pytest.fixture()
def client(server):
  return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def _raw(base, path, body: bytes):
  req = urllib.request.Request(base + path, data=body, headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=60) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_openai_client_round_trip(client, alone, model):
  assert [m.id for m in client.models.list().data] == ["default"]
  r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "What is 348+279?"}])
  # Chat answers as the CLI prints (the model's column padding stripped), as the README says: 627.
  assert r.choices[0].message.content == alone["What is 348+279?"].strip() == "627"
  assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4
  # Multi-turn with a system prompt: the embedded model answers single questions and its template has no
  # place for a system message, so the client gets a 400 saying so (test_limits has each case).
  with pytest.raises(openai.BadRequestError, match="answers single questions"):
    client.chat.completions.create(model="default", messages=[
        {"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "12 x 13"},
        {"role": "assistant", "content": " 156"}, {"role": "user", "content": "What is 348+279?"}])
  # Completion on the raw (template-free) text, and on token ids.
  tok = model.tokenizer
  text = tok.apply_chat_template([{"role": "user", "content": "61*7"}], tokenize=False, add_generation_prompt=True)
  r = client.completions.create(model="default", prompt=text)
  assert r.choices[0].text == alone["61*7"]
  r2 = client.completions.create(model="default", prompt=tok.encode(text, add_special_tokens=False))
  assert r2.choices[0].text == r.choices[0].text
  # The model lists its trained tasks: each answer says which one its prompt falls in (null: none).
  r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "12 x 13"}])
  assert r.model_extra["dinfer"]["trained_task"] == [None]
  r = client.completions.create(model="default", prompt=[text, "<|user|>348+279<|assistant|>"])
  assert r.model_extra["dinfer"]["trained_task"] == ["arithmetic", "arithmetic"]


def test_stop_sequences_cut_the_answer(client, alone):
  full = alone["f(0..5)=2,5,8,11,14,17"]
  assert "+" in full
  r = client.chat.completions.create(model="default", stop=["+"],
                                     messages=[{"role": "user", "content": "f(0..5)=2,5,8,11,14,17"}])
  assert r.choices[0].message.content == full[:full.index("+")].strip() and r.choices[0].finish_reason == "stop"
  r = client.chat.completions.create(model="default", max_tokens=2,
                                     messages=[{"role": "user", "content": "f(0..5)=2,5,8,11,14,17"}])
  assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "length"


def test_streaming_sends_one_chunk_per_block(client, alone):
  # A long sum: the model's prompt rule gives it 32 positions in four blocks of 8 (the short default of 8
  # would cut it), and each committed block is streamed as it lands.
  a, b = 123456789012345678, 987654321098765432
  chunks = list(client.chat.completions.create(model="default", stream=True,
                                               messages=[{"role": "user", "content": f"What is {a} + {b}?"}]))
  pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
  assert "".join(pieces) == str(a + b)  # streamed chat: stripped as the whole answer is
  assert len(pieces) == 4  # 25 right-aligned characters over blocks of 8
  assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "stop"
  q = "f(0..5)=2,5,8,11,14,17"
  comp = list(client.completions.create(model="default", stream=True, stop=["+"],
                                        prompt="<|user|>f(0..5)=2,5,8,11,14,17<|assistant|>"))
  assert "".join(c.choices[0].text for c in comp) == alone[q][:alone[q].index("+")]


def test_64_concurrent_clients_get_their_single_request_answers(server, alone):
  """64 clients, mixed prompt lengths (two prompt buckets), at once: none lost, every answer equal to its
  prompt run alone, each request in at least one engine call (continuous batching: one call decodes one
  block of each running row; which batch buckets are compiled yet while the warm-up runs decides how many
  rows share a call, so that is tested in test_continuous with its programs compiled)."""
  def metrics():
    with urllib.request.urlopen(server + "/metrics", timeout=30) as r:
      return {l.split()[0]: float(l.split()[1]) for l in r.read().decode().splitlines()
              if l and not l.startswith("#") and "{" not in l}

  before = metrics()

  def ask(i):
    q = QUESTIONS[i % len(QUESTIONS)]
    c = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    return q, c.chat.completions.create(model="default", messages=[{"role": "user", "content": q}])

  t = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(64) as ex:
    got = list(ex.map(ask, range(64)))
  assert time.monotonic() - t < 120
  assert len(got) == 64
  for q, r in got:
    assert r.choices[0].message.content == alone[q].strip(), q
  after = metrics()
  calls = after["dinfer_engine_calls_total"] - before["dinfer_engine_calls_total"]
  rows = after["dinfer_batch_rows_sum"] - before["dinfer_batch_rows_sum"]
  assert rows >= 64 and 0 < calls <= rows
  assert after["dinfer_batch_rows_count"] - before["dinfer_batch_rows_count"] == calls


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b'{"model": "nope", "prompt": "1+1"}', 404, "model"),
    (json.dumps({"model": "default", "prompt": "1" * 200}).encode(), 400, "prompt"),
    (b'{"model": "default", "prompt": "1+1", "temperature": -1}', 400, "temperature"),
    (b'{"model": "default", "prompt": "1+1", "n": 0}', 400, "n"),
    (b'{"model": "default", "prompt": "1+1", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "default", "prompt": "1+1", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop"),
    (b'{"model": "default", "prompt": [1, 2, 999]}', 400, "prompt"),
    (b'{"model": "default", "prompt": [1, 2, 2]}', 400, "prompt"),
    (b'{"model": "default"}', 400, "prompt"),
    (b'{"model": "default", "prompt": [999999, -5]}', 400, "prompt"),  # ids outside the vocabulary
    (b'{"model": "default", "prompt": [[4, 5], [4, -1, 5]]}', 400, "prompt"),
    (json.dumps({"model": "default", "prompt": "1+1", "max_tokens": 2**70}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "default", "prompt": "1+1", "seed": 2**70}).encode(), 400, "seed"),
    (b'{"model": "default", "prompt": "\\ud800 1+1"}', 400, "prompt"),  # a lone surrogate
    (b'[1, 2]', 400, None),
    (b'{"model": "default", "prompt": "1+1", "logprobs": 2}', 400, "logprobs"),  # not served: not ignored
])
def test_bad_input_is_a_4xx_with_an_openai_error(server, body, status, param):
  code, out = _raw(server, "/v1/completions", body)
  assert code == status, out
  err = out["error"]
  assert err["message"] and err["type"] and err["param"] == param
  # ... and the server keeps serving.
  code, out = _raw(server, "/v1/completions", b'{"model": "default", "prompt": "<|user|>348+279<|assistant|>"}')
  assert code == 200 and out["choices"][0]["text"].strip() == "627"


def test_chat_bad_messages(server):
  code, out = _raw(server, "/v1/chat/completions", b'{"model": "default", "messages": []}')
  assert code == 400 and out["error"]["param"].startswith("messages")
  code, out = _raw(server, "/v1/chat/completions", b'{"model": "default", "messages": [{"role": "robot", '
                                                   b'"content": "1"}]}')
  assert code == 400 and "role" in out["error"]["param"]
  code, out = _raw(server, "/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", '
                                                   b'"content": "\\udc00"}]}')
  assert code == 400 and out["error"]["param"] == "messages[0].content", out


def test_metrics_and_health(server):
  with urllib.request.urlopen(server + "/health", timeout=10) as r:
    assert json.loads(r.read())["status"] == "ok"
  with urllib.request.urlopen(server + "/metrics", timeout=10) as r:
    text = r.read().decode()
  for name in ("dinfer_requests_total", "dinfer_generated_tokens_total", "dinfer_tokens_per_forward",
               "dinfer_queue_depth", "dinfer_batch_rows_bucket", "dinfer_request_latency_seconds_bucket"):
    assert name in text


def test_bench_server_mode(server, tmp_path, capsys):
  out = tmp_path / "b.json"
  assert cli.main(["bench", "--server", server, "--requests", "24", "--concurrency", "8", "--json", str(out)]) == 0
  res = json.loads(out.read_text())
  assert res["errors"] == 0 and res["requests"] == 24 and res["completion_tokens"] > 0
  assert 0 < res["latency_p50_s"] <= res["latency_p99_s"]
  assert res["engine_calls"] >= 1 and res["throughput_rps"] > 0 and res["mode"] == "closed"
  assert "p99" in capsys.readouterr().out


def test_bench_server_open_loop(server, tmp_path, capsys):
  """Poisson arrivals at a fixed rate: every request sent, the JSON has the closed loop's fields, and at a
  rate the server keeps up with the throughput follows the rate (not the server's speed)."""
  out = tmp_path / "o.json"
  args = ["bench", "--server", server, "--arrival", "poisson", "--rate", "8", "--requests", "16", "--seed", "3",
          "--json", str(out)]
  assert cli.main(args) == 0
  res = json.loads(out.read_text())
  assert (res["mode"], res["sent"], res["errors"], res["rate_rps"], res["seed"]) == ("open", 16, 0, 8.0, 3)
  assert 0 < res["p50_s"] <= res["p99_s"]
  from dinfer_jax.bench.server import arrival_times
  assert res["wall_s"] >= arrival_times(8.0, 16, 3)[-1]  # the last one was sent at its scheduled time
  assert "Poisson arrivals at 8/s" in capsys.readouterr().out
