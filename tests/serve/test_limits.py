"""The server's limits in process (no engine call runs: the batcher's worker is never started): a full
queue answers 429, a request past its timeout 504 (and is dropped from the queue), both OpenAI-style."""
import asyncio
import contextlib
import time

import pytest

try:  # the test extra brings httpx2 (through openai); older stacks have httpx
  import httpx2 as httpx
except ImportError:
  httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from dinfer_jax.serve.app import ServerConfig, create_app  # noqa: E402
from dinfer_jax.serve.batcher import DynamicBatcher  # noqa: E402
from dinfer_jax.serve.metrics import Metrics  # noqa: E402


def test_full_queue_is_429_and_timeout_is_504(default_model, default_gcfg):
  metrics = Metrics(2)
  batcher = DynamicBatcher(default_model, max_batch=2, max_queue=1, on_drop=metrics.drop)
  app = create_app(default_model, batcher, metrics, ServerConfig("default", default_gcfg, timeout_s=1.0))
  body = {"model": "default", "prompt": "<|user|>348+279<|assistant|>"}

  async def scenario():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
      first = asyncio.create_task(c.post("/v1/completions", json=body))  # waits in the queue
      await asyncio.sleep(0.3)
      assert batcher.depth == 1
      second = await c.post("/v1/completions", json=body)
      return await first, second

  first, second = asyncio.run(scenario())
  assert second.status_code == 429 and second.json()["error"]["type"] == "rate_limit_error"
  assert first.status_code == 504 and first.json()["error"]["code"] == "timeout"
  # The timed-out request is dropped when the worker gets to it, not run.
  assert batcher._next_batch() == [] and metrics.dropped == 1 and batcher.depth == 0


def test_bodies_routes_and_methods_get_openai_errors(default_model, default_gcfg):
  """Every refusal is OpenAI's error body: oversized bodies (declared or chunked) 413 before they are read
  whole, unparsable ones (invalid UTF-8, nesting too deep) 400, unknown routes 404, wrong methods 405."""
  batcher = DynamicBatcher(default_model, max_batch=2)
  app = create_app(default_model, batcher, Metrics(2), ServerConfig("default", default_gcfg,
                                                                    max_body_bytes=2**20))
  big = b'{"model": "default", "prompt": "' + b"1" * (2 * 2**20) + b'"}'
  deep = b'{"model": "default", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

  async def scenario():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
      post = lambda body: c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
      chunks = iter([big[i:i + 65536] for i in range(0, len(big), 65536)])

      async def streamed():
        for x in chunks:
          yield x
      return [await post(big), await post(streamed()), await post(b'{"model": "default", "prompt": "\xff"}'),
              await post(deep), await c.get("/v1/nothing"), await c.get("/v1/completions"), await c.get("/health")]

  out = asyncio.run(scenario())
  assert [r.status_code for r in out] == [413, 413, 400, 400, 404, 405, 200]
  for r in out[:-1]:
    err = r.json()["error"]
    assert err["message"] and err["type"], r.text
  assert "larger than 1048576 bytes" in out[0].json()["error"]["message"]


def test_api_key_guards_the_api_not_the_probes(default_model, default_gcfg):
  app = create_app(default_model, DynamicBatcher(default_model, max_batch=2), Metrics(2),
                   ServerConfig("default", default_gcfg, api_key="s3cret"))

  async def scenario():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
      return [await c.get("/v1/models"), await c.get("/v1/models", headers={"Authorization": "Bearer wrong"}),
              await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}), await c.get("/health")]

  out = asyncio.run(scenario())
  assert [r.status_code for r in out] == [401, 401, 200, 200]
  assert out[0].json()["error"]["code"] == "invalid_api_key"


def test_non_loopback_without_a_key_is_warned_about():
  from dinfer_jax.serve.cli import is_loopback
  assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
  assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("myhost")


@contextlib.contextmanager
def _raw_server():
  """A uvicorn server with the serve protocol's deadlines (headers 1 s, body 1 s) around an app that reads the
  whole body and answers ok; yields its port."""
  import socket
  import threading

  import uvicorn

  from dinfer_jax.serve.protocol import with_header_timeout

  async def app(scope, receive, send):
    if scope["type"] != "http":
      return
    more = True
    while more:
      more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                         http=with_header_timeout(1.0, 1.0), timeout_keep_alive=30))
  t = threading.Thread(target=server.run, daemon=True)
  t.start()
  try:
    deadline = time.monotonic() + 20
    while not server.started:
      assert time.monotonic() < deadline
      time.sleep(0.05)
    yield port
  finally:
    server.should_exit = True
    t.join(10)


def test_a_body_sent_a_byte_at_a_time_is_cut_off():
  """A request whose body does not arrive within the body deadline of its headers is closed (at a byte per
  0.3 s a 100-byte body would take 30 s); a body that arrives is answered."""
  import socket
  with _raw_server() as port:
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
    t0, closed = time.monotonic(), False
    while time.monotonic() - t0 < 8:
      try:
        slow.sendall(b"x")
      except OSError:
        closed = True
        break
      slow.settimeout(0.3)
      try:
        if slow.recv(4096) == b"":
          closed = True
          break
      except socket.timeout:
        pass
    assert closed and time.monotonic() - t0 < 4
    ok = socket.create_connection(("127.0.0.1", port))
    ok.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc")
    ok.settimeout(10)
    assert ok.recv(4096).startswith(b"HTTP/1.1 200")
    slow.close()
    ok.close()


def test_half_sent_headers_are_cut_off_and_whole_requests_served():
  """Connections whose request headers never complete (slowloris) are closed after the headers deadline,
  also between requests of a keep-alive connection; complete requests are served."""
  import socket
  with _raw_server() as port:
    slow = []
    for _ in range(20):
      c = socket.create_connection(("127.0.0.1", port))
      c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line
      slow.append(c)
    silent = socket.create_connection(("127.0.0.1", port))  # never sends a byte
    keep = socket.create_connection(("127.0.0.1", port))
    keep.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    got = b""
    while not got.endswith(b"ok"):
      got += keep.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    keep.sendall(b"GET / HTTP/1.1\r\nHo")  # the second request's head stalls
    t0 = time.monotonic()
    for c in slow + [silent, keep]:
      c.settimeout(10)
      assert c.recv(4096) == b"", "a half-sent request head was answered or kept open"
    assert time.monotonic() - t0 < 8
    ok = socket.create_connection(("127.0.0.1", port))
    ok.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert ok.recv(4096).startswith(b"HTTP/1.1 200")
    for c in slow + [silent, keep, ok]:
      c.close()


def test_metrics_labels_stay_bounded_and_parse(default_model, default_gcfg):
  """Paths nobody routes (a 4 KB one, one with a quote and a backslash) count under one `other` label, so
  /metrics neither grows with what clients request nor stops parsing; label values are escaped."""
  metrics = Metrics(2)
  app = create_app(default_model, DynamicBatcher(default_model, max_batch=2), metrics,
                   ServerConfig("default", default_gcfg))
  paths = [f"/nothing/{i}" for i in range(40)] + ["/x" * 2048, '/a"b\\c']

  async def scenario():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
      codes = [(await c.get(p)).status_code for p in paths]
      return codes, (await c.get("/metrics")).text

  codes, text = asyncio.run(scenario())
  assert set(codes) == {404}
  labelled = [ln for ln in text.splitlines() if ln.startswith("dinfer_requests_total{")]
  assert labelled == ['dinfer_requests_total{endpoint="other",status="404"} 42.0']
  import re
  sample = re.compile(r'[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]\w*="(\\.|[^"\\\n])*",?)*\})? [-+0-9.eE]+(e[+-]?\d+)?|[-+]?Inf|NaN')
  assert all(ln.startswith("#") or sample.fullmatch(ln) for ln in text.splitlines() if ln), text
  # Without routes (a bare Metrics), a value with a quote, a backslash and a newline is escaped.
  m = Metrics(2)
  m.request('a"b\\c\nd', 404)
  assert 'dinfer_requests_total{endpoint="a\\"b\\\\c\\nd",status="404"} 1.0' in m.render()
  # and the exposition reads back to the same value.
  from prometheus_client.parser import text_string_to_metric_families
  fams = {f.name: f for f in text_string_to_metric_families(m.render())}
  assert [(x.labels, x.value) for x in fams["dinfer_requests"].samples] == [
      ({"endpoint": 'a"b\\c\nd', "status": "404"}, 1.0)]


def test_prompt_lists_are_bounded_and_token_ids_are_integers(default_model, default_gcfg):
  """More prompts than the queue holds are a 400 naming the limit, refused before any is encoded; JSON
  booleans are not token ids."""
  app = create_app(default_model, DynamicBatcher(default_model, max_batch=2, max_queue=8), Metrics(2),
                   ServerConfig("default", default_gcfg))

  async def scenario():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
      many = await c.post("/v1/completions", json={"model": "default", "prompt": ["1+1"] * 100_000})
      flags = await c.post("/v1/completions", json={"model": "default", "prompt": [True, False]})
      nested = await c.post("/v1/completions", json={"model": "default", "prompt": [[4, 5], [True, 5]]})
      return many, flags, nested

  many, flags, nested = asyncio.run(scenario())
  assert many.status_code == 400 and many.json()["error"]["param"] == "prompt"
  assert "100000 prompts" in many.json()["error"]["message"] and "at most 8" in many.json()["error"]["message"]
  for r in (flags, nested):
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt"), r.json()


def test_host_header_is_checked_and_the_schema_is_closed(default_model, default_gcfg):
  """With allowed hosts (serve's default without an API key: the bound address and localhost), a request
  naming another host (a rebinding web page's) is a 400; /openapi.json is not served."""
  from dinfer_jax.serve.app import host_name
  assert [host_name(h) for h in ("LocalHost:8000", "[::1]:80", "::1", "127.0.0.1")] == [
      "localhost", "::1", "::1", "127.0.0.1"]
  app = create_app(default_model, DynamicBatcher(default_model, max_batch=2), Metrics(2),
                   ServerConfig("default", default_gcfg, allowed_hosts=("127.0.0.1", "localhost")))

  async def scenario():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as c:
      return ((await c.get("/health", headers={"Host": "evil.example"})), (await c.get("/health")),
              (await c.get("/health", headers={"Host": "localhost:8000"})), (await c.get("/openapi.json")))

  evil, ok, local, schema = asyncio.run(scenario())
  assert evil.status_code == 400 and evil.json()["error"]["code"] == "invalid_host"
  assert ok.status_code == 200 and local.status_code == 200 and schema.status_code == 404


def test_serve_allows_the_bound_host_and_localhost_without_a_key():
  import argparse

  from dinfer_jax.serve import cli as serve_cli
  p = argparse.ArgumentParser()
  serve_cli.register(p.add_subparsers())
  args = lambda *a: p.parse_args(["serve", *a])  # noqa: E731
  assert serve_cli.allowed_hosts(args()) == ("127.0.0.1", "localhost", "::1")
  assert serve_cli.allowed_hosts(args("--host", "10.0.0.5")) == ("10.0.0.5", "localhost", "127.0.0.1", "::1")
  assert serve_cli.allowed_hosts(args("--api-key", "k")) is None
  assert serve_cli.allowed_hosts(args("--allowed-hosts", "*")) is None
  assert serve_cli.allowed_hosts(args("--allowed-hosts", "a.example, b.example")) == ("a.example", "b.example")


def test_serve_runs_uvicorn_with_the_deadlines(monkeypatch):
  """`serve` hands uvicorn the body deadline (in its protocol) and a graceful-shutdown limit, after which
  connections still open are closed (a client that never finished its body held up SIGTERM for ever)."""
  import argparse

  import uvicorn

  from dinfer_jax.serve import cli as serve_cli
  seen = {}

  class Server:  # runs nothing: what cmd_serve hands uvicorn
    def __init__(self, config):
      seen["config"], self.started = config, True

    def run(self, sockets):
      seen["sockets"] = sockets
  monkeypatch.setattr(uvicorn, "Server", Server)
  p = argparse.ArgumentParser()
  serve_cli.register(p.add_subparsers())
  args = p.parse_args(["serve", "--port", "0", "--warmup-max-prompt-len", "0", "--shutdown-timeout-s", "7",
                       "--body-timeout-s", "3"])
  assert serve_cli.cmd_serve(args) == 0
  assert seen["config"].timeout_graceful_shutdown == 7 and seen["config"].http.__name__ == "HeaderDeadlineProtocol"
  assert seen["sockets"][0].getsockname()[1] > 0  # bound before the model loaded
  seen["sockets"][0].close()
  with pytest.raises(SystemExit, match="--body-timeout-s 0.0: must be > 0"):
    serve_cli.cmd_serve(p.parse_args(["serve", "--body-timeout-s", "0"]))


def test_chat_refuses_what_would_not_reach_the_model(default_model, default_gcfg):
  """A system message the template drops, history to a single-question model and an empty message are each a
  400 saying why (before: the system message vanished, two turns were answered '' with nfe 2, and empty
  content was answered '000+')."""
  app = create_app(default_model, DynamicBatcher(default_model, max_batch=2), Metrics(2),
                   ServerConfig("default", default_gcfg))
  cases = {"no place for a system message": [{"role": "system", "content": "Be terse."},
                                             {"role": "user", "content": "1+1"}],
           "3 turns, but the model at .* answers single questions": [
               {"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"},
               {"role": "user", "content": "2+2"}],
           r"message 0 \(user\) is empty": [{"role": "user", "content": ""}]}

  async def scenario():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
      return [await c.post("/v1/chat/completions", json={"model": "default", "messages": m}) for m in cases.values()]

  import re
  for why, r in zip(cases, asyncio.run(scenario())):
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.json()
    assert re.search(why, r.json()["error"]["message"]), r.json()
