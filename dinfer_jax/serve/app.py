"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics.

Streaming (`"stream": true`) sends server-sent events while the engine runs: the batcher hands over each
row's tokens as every block is committed (continuous batching reads them at each block boundary; window
batching through engine.generate's on_block, an io_callback inside the block loop), and the new settled
text of each block is sent at once.

Bad input (malformed JSON, unknown model, a prompt the model cannot fit, invalid knobs) is answered with a
4xx and an OpenAI-style body {"error": {"message", "type", "param", "code"}}; the server keeps serving.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from typing import Any, Callable, Literal, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from dinfer_jax.answer import cut_at_stop, settled_prefix, shown_answer, with_token_cap
from dinfer_jax.cli_common import chat_text, prompt_tasks, trained_tasks
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.serve.batcher import Batcher, Job, QueueFull
from dinfer_jax.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics


class APIError(Exception):
  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_response(status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
  return JSONResponse(status_code=status,
                      content={"error": {"message": message, "type": type, "param": param, "code": code}})


class _Knobs(BaseModel):
  model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we have no use for (user, ...)
  model: str
  max_tokens: int | None = Field(default=None, ge=1)
  max_completion_tokens: int | None = Field(default=None, ge=1)
  temperature: float | None = Field(default=None, ge=0.0, le=2.0)
  seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # an int64, as vLLM takes it
  n: int = Field(default=1, ge=1, le=128)
  stop: Union[str, list[str], None] = None
  stream: bool = False
  # Log-probabilities are not served (a denoised token has no left-to-right probability to report): asking
  # for them is a 400, not an answer without them.
  logprobs: Union[bool, int, None] = None
  top_logprobs: int | None = None


class CompletionRequest(_Knobs):
  # Strict ints: JSON true/false are not token ids (pydantic's lax mode would read them as 1 and 0).
  prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]


class ChatMessage(BaseModel):
  model_config = ConfigDict(extra="ignore")
  role: Literal["system", "user", "assistant"]
  content: str


class ChatRequest(_Knobs):
  messages: list[ChatMessage] = Field(min_length=1)


@dataclasses.dataclass
class ServerConfig:
  model_name: str
  gcfg: GenerationConfig  # the server's defaults (flags > the model's generation_config.json > dataclass)
  timeout_s: float = 120.0
  # The defaults for one prompt (token ids as the model sees them): the model's prompt rule for it applied
  # (e.g. a long sum gets its 32 positions, not the short default), flags still winning. None: gcfg.
  config_for: Callable[[Sequence[int]], GenerationConfig] | None = None
  # Larger request bodies get 413 before they are read whole (a 20 MB prompt cannot fit any model here).
  max_body_bytes: int = 4 * 2**20
  # Required as "Authorization: Bearer KEY" on /v1/* when set (as vLLM's --api-key); /health and /metrics
  # stay open for probes.
  api_key: str | None = None
  # The Host names requests may carry (None: any). Without an API key the CLI allows only the bound address
  # and localhost: a web page cannot reach a server on this machine by rebinding its own name to 127.0.0.1.
  allowed_hosts: tuple[str, ...] | None = None


class _BodyLimit:
  """ASGI middleware: 413 for a body over `limit` bytes, by its Content-Length or, when chunked, as soon as
  the bytes received pass it (the rest is never read)."""

  def __init__(self, app, limit: int):
    self.app, self.limit = app, limit

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    declared = dict(scope.get("headers") or []).get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > self.limit:
      return await self._refuse(send)
    seen = 0

    async def counting():
      nonlocal seen
      msg = await receive()
      if msg["type"] == "http.request":
        seen += len(msg.get("body", b""))
        if seen > self.limit:  # an HTTPException: FastAPI passes it on while it reads the body
          raise StarletteHTTPException(413, self.message())
      return msg

    return await self.app(scope, counting, send)

  def message(self) -> str:
    return f"request body larger than {self.limit} bytes"

  async def _refuse(self, send):
    body = json.dumps({"error": {"message": self.message(), "type": "invalid_request_error", "param": None,
                                 "code": "request_too_large"}})
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body.encode()})


def unicode_text(text: str, param: str) -> str:
  """text, if it can be encoded (JSON may carry a lone surrogate, "\\ud800", that no tokenizer takes)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise APIError(400, f"{param}: not valid Unicode text (a lone surrogate at character {e.start})",
                   param=param) from None
  return text


def stop_list(req: _Knobs) -> list[str]:
  return [req.stop] if isinstance(req.stop, str) else (req.stop or [])


def token_cap(req: _Knobs) -> int | None:
  return req.max_completion_tokens or req.max_tokens


def usage(prompt_tokens: int, outs: Sequence[tuple]) -> dict[str, Any]:
  """OpenAI's usage block; outs are finish() results (their third item the answer's tokens)."""
  ntok = sum(len(o[2]) for o in outs)
  return {"prompt_tokens": prompt_tokens, "completion_tokens": ntok, "total_tokens": prompt_tokens + ntok}


class Service:
  """What the routes do, without HTTP: request validation, prompt encoding, queueing on the batcher, waiting,
  and the answers' text. One per app (create_app)."""

  def __init__(self, model, batcher: Batcher, metrics: Metrics, cfg: ServerConfig):
    self.model, self.batcher, self.metrics, self.cfg = model, batcher, metrics, cfg
    self.tok = model.tokenizer
    self.task_names = trained_tasks(model)

  # ------------------------------------------------------------------ validation and encoding
  def request_config(self, req: _Knobs, prompt: Sequence[int]) -> GenerationConfig:
    """The prompt's GenerationConfig: the server's defaults (the model's prompt rule for it), the request's
    token cap and temperature; APIError for what the request gets wrong."""
    cfg, mcfg = self.cfg, self.model.config
    if req.model != cfg.model_name:
      raise APIError(404, f"model {req.model!r} does not exist; this server serves {cfg.model_name!r}",
                     param="model", code="model_not_found")
    base = cfg.config_for(prompt) if cfg.config_for is not None else cfg.gcfg
    cap = token_cap(req)
    if cap is not None and cap > mcfg.max_position:
      name = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
      raise APIError(400, f"{name}: {cap} is more than the model's context ({mcfg.max_position} positions)",
                     param=name)
    g = with_token_cap(base, cap)
    if req.temperature is not None:
      g = g.replace(temperature=float(req.temperature))
    stops = stop_list(req)
    if len(stops) > 4 or any(not s for s in stops):
      raise APIError(400, "stop: at most 4 non-empty stop sequences", param="stop")
    for name in ("logprobs", "top_logprobs"):
      if getattr(req, name) not in (None, False):
        raise APIError(400, f"{name}: log-probabilities are not supported by this server", param=name)
    return g

  def encode_text(self, text: str) -> list[int]:
    if self.tok is None:
      raise APIError(400, f"model {self.cfg.model_name!r} has no tokenizer: send prompts as token-id lists",
                     param="prompt")
    return self.tok.encode(unicode_text(text, "prompt"), add_special_tokens=False)

  def token_ids(self, ids: list[int]) -> list[int]:
    V = self.model.config.vocab_size
    bad = next((x for x in ids if not 0 <= x < V), None)
    if bad is not None:
      raise APIError(400, f"prompt: token id {bad} is outside the vocabulary [0, {V})", param="prompt")
    return list(ids)

  def completion_prompts(self, p) -> list[list[int]]:
    """/v1/completions' prompt field -> token-id prompts. More prompts than the queue holds are refused before
    any is encoded (a 100,000-prompt request could never run, and encoding it took 20 s)."""
    many = isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p)
    if many and len(p) > self.batcher.max_queue:
      raise APIError(400, f"prompt: {len(p)} prompts in one request; this server queues at most "
                          f"{self.batcher.max_queue} (--max-queue)", param="prompt")
    if isinstance(p, str):
      prompts = [self.encode_text(p)]
    elif p and all(isinstance(x, int) for x in p):
      prompts = [self.token_ids(p)]
    elif p and all(isinstance(x, str) for x in p):
      prompts = [self.encode_text(x) for x in p]
    elif p and all(isinstance(x, list) for x in p):
      prompts = [self.token_ids(x) for x in p]
    else:
      raise APIError(400, "prompt: a string, a list of strings, a token-id list or a list of token-id lists",
                     param="prompt")
    if any(len(x) == 0 for x in prompts):
      raise APIError(400, "prompt: empty prompt", param="prompt")
    return prompts

  def chat_prompt(self, messages) -> list[int]:
    """/v1/chat/completions' messages -> one prompt, through the model's chat template."""
    if self.tok is None or not getattr(self.tok, "chat_template", None):
      raise APIError(400, f"model {self.cfg.model_name!r} has no chat template; use /v1/completions",
                     param="messages")
    msgs = [{"role": m.role, "content": unicode_text(m.content, f"messages[{i}].content")}
            for i, m in enumerate(messages)]
    try:
      text = chat_text(self.model, msgs, self.task_names, "messages")
    except ValueError as e:  # empty, a system message or history that would not reach the model
      raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # noqa: BLE001 - the template itself refuses (e.g. roles out of order)
      raise APIError(400, f"messages: the chat template refused them: {e}", param="messages") from None
    return self.tok.encode(text, add_special_tokens=False)

  def check(self, prompt: list[int], g: GenerationConfig, req: _Knobs, param: str) -> None:
    try:
      self.batcher.validate(prompt, g, req.n)
    except ValueError as e:
      code = "context_length_exceeded" if "max_position" in str(e) else None
      raise APIError(400, str(e).removeprefix("generate: "), param=param, code=code) from None

  def configs(self, req: _Knobs, prompts: list[list[int]], param: str) -> list[GenerationConfig]:
    """Per prompt (prompts may match different rules) its config, every prompt checked before any is queued."""
    gs = [self.request_config(req, p) for p in prompts]
    for p, g in zip(prompts, gs):
      self.check(p, g, req, param)
    return gs

  # ------------------------------------------------------------------ the engine
  def submit(self, prompt: list[int], g: GenerationConfig, req: _Knobs, events: asyncio.Queue | None = None,
             index: int = 0):
    """Queues one prompt; (job, future). With `events`, ("tokens", index, rows) arrive there as blocks are
    committed and ("done", index, result) at the end."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def done(result):
      def put():
        if not fut.done():
          fut.set_result(result)
        if events is not None:
          events.put_nowait(("done", index, result))
      loop.call_soon_threadsafe(put)

    on_tokens = None
    if events is not None:
      def on_tokens(rows):
        loop.call_soon_threadsafe(events.put_nowait, ("tokens", index, rows))

    seed = req.seed if req.seed is not None else (uuid.uuid4().int & 0x7FFFFFFF)
    job = Job(prompt=list(prompt), gcfg=g, on_done=done, n=req.n, seed=int(seed), on_tokens=on_tokens)
    try:
      self.batcher.submit(job)
    except QueueFull as e:
      raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
    return job, fut

  def submit_all(self, prompts, gs, req, events=None):
    jobs = []
    try:
      for i, (p, g) in enumerate(zip(prompts, gs)):
        jobs.append(self.submit(p, g, req, events, i))
    except APIError:
      for j, _ in jobs:
        j.cancel()
      raise
    return jobs

  async def wait(self, disconnected: Callable[[], Any], job: Job, fut: asyncio.Future):
    """The job's result; cancels it when the client leaves (`disconnected`, awaitable) or the timeout passes."""
    deadline = time.monotonic() + self.cfg.timeout_s
    try:
      while not fut.done():
        if await disconnected():  # nobody will read the answer: free its place in the queue
          job.cancel()
          raise APIError(499, "the client closed the request", code="client_closed")
        if time.monotonic() > deadline:
          job.cancel()
          raise APIError(504, f"the request did not finish within {self.cfg.timeout_s:g}s", type="timeout_error",
                         code="timeout")
        await asyncio.wait({fut}, timeout=0.05)
    except asyncio.CancelledError:
      job.cancel()
      raise
    result = fut.result()
    if isinstance(result, BaseException):
      raise APIError(500, f"generation failed: {type(result).__name__}: {result}", type="server_error")
    return result

  # ------------------------------------------------------------------ answers
  def decode(self, ids) -> str:
    if self.tok is None:
      return " ".join(str(i) for i in ids)
    return self.tok.decode(list(ids), skip_special_tokens=True)

  def finish(self, choice, req: _Knobs, chat: bool) -> tuple[str, str, list[int]]:
    """(answer text, finish_reason, its tokens): cut to the token cap, then before a stop sequence; a chat
    answer as the CLI shows it (a completion is a continuation: its whitespace is kept)."""
    cap = token_cap(req)
    tokens = choice.tokens[:cap] if cap else choice.tokens
    text, stopped = cut_at_stop(self.decode(tokens), stop_list(req))
    text = shown_answer(text) if chat else text
    ended = len(choice.tokens) < choice.gen_length  # the model wrote EOS
    reason = "stop" if stopped or (ended and (cap is None or len(choice.tokens) <= cap)) else "length"
    return text, reason, tokens

  def response(self, req: _Knobs, prompts, results, chat: bool, rid: str, created: int) -> dict[str, Any]:
    """The non-streaming response body of the prompts' results (one list of choices per prompt)."""
    outs = [self.finish(c, req, chat) + (c.row_nfe,) for choices in results for c in choices]
    nfe = sum(o[3] for o in outs)
    stats = {"nfe": nfe, "tpf": (sum(len(o[2]) for o in outs) / nfe) if nfe else 0.0}
    if self.task_names is not None:  # per prompt, the trained task it falls in (null: outside them: likely wrong)
      stats["trained_task"] = prompt_tasks(self.model, self.task_names, prompts)
    if chat:
      ch = [{"index": i, "message": {"role": "assistant", "content": o[0]}, "finish_reason": o[1],
             "logprobs": None} for i, o in enumerate(outs)]
    else:
      ch = [{"index": i, "text": o[0], "finish_reason": o[1], "logprobs": None} for i, o in enumerate(outs)]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": self.cfg.model_name, "choices": ch, "usage": usage(sum(len(p) for p in prompts), outs),
            "dinfer": stats}

  async def serve(self, request: Request, req: _Knobs, prompts: list[list[int]], chat: bool, param: str):
    t0 = time.perf_counter()
    # Each prompt's rule and validation: off the event loop, as the encoding (/health answers meanwhile).
    gs = await asyncio.to_thread(self.configs, req, prompts, param)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if req.stream:
      events: asyncio.Queue = asyncio.Queue()
      jobs = self.submit_all(prompts, gs, req, events)  # a full queue is still a plain 429
      sse = SSEStream(self, req, len(prompts), chat, rid, created, events, jobs)
      return StreamingResponse(sse.run(request.is_disconnected, request.url.path, t0),
                               media_type="text/event-stream")
    jobs = self.submit_all(prompts, gs, req)
    results = await asyncio.gather(*(self.wait(request.is_disconnected, j, f) for j, f in jobs))
    body = self.response(req, prompts, results, chat, rid, created)
    self.metrics.request(request.url.path, 200, time.perf_counter() - t0)
    return JSONResponse(body)


class SSEStream:
  """Server-sent events as blocks are committed inside the running engine program: each event carries the
  answer's newly settled text (answer.settled_prefix); the last one per choice its finish_reason. `events`
  receives the jobs' ("tokens", prompt index, rows) and ("done", prompt index, result) (Service.submit)."""

  def __init__(self, service: Service, req: _Knobs, n_prompts: int, chat: bool, rid: str, created: int,
               events: asyncio.Queue, jobs: list):
    self.service, self.req, self.chat, self.rid, self.created = service, req, chat, rid, created
    self.events, self.jobs, self.n_prompts = events, jobs, n_prompts
    self.sent = [""] * (n_prompts * req.n)  # per choice, the text sent so far
    self.done: set[int] = set()

  def event(self, i: int, piece: str | None, reason: str | None, first: bool = False) -> str:
    if self.chat:
      delta = ({"role": "assistant", "content": ""} if first else {}) if piece is None else {"content": piece}
      c = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": None}
    else:
      c = {"index": i, "text": piece or "", "finish_reason": reason, "logprobs": None}
    return "data: " + json.dumps({"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                                  "created": self.created, "model": self.service.cfg.model_name,
                                  "choices": [c]}) + "\n\n"

  @staticmethod
  def error_event(status: int, message: str, type_: str) -> str:
    return "data: " + json.dumps({"error": {"message": message, "type": type_, "param": None,
                                            "code": status}}) + "\n\n"

  def on_tokens(self, k: int, payload) -> list[str]:
    """Events for prompt k's rows committed so far: each choice's newly settled text."""
    n, cap = self.req.n, token_cap(self.req)
    rows = payload if len(payload) == n else payload * n  # greedy: one row serves every choice
    out = []
    for c, toks in enumerate(rows):
      i = k * n + c
      text = settled_prefix(self.service.decode(toks[:cap] if cap else toks), stop_list(self.req))
      text = shown_answer(text) if self.chat else text
      if i not in self.done and len(text) > len(self.sent[i]) and text.startswith(self.sent[i]):
        out.append(self.event(i, text[len(self.sent[i]):], None))
        self.sent[i] = text
    return out

  def on_done(self, k: int, payload) -> list[str]:
    """Events for prompt k's finished choices: what is left of each answer, then its finish_reason."""
    out = []
    for c, choice in enumerate(payload):
      i = k * self.req.n + c
      text, reason, _ = self.service.finish(choice, self.req, self.chat)
      if len(text) > len(self.sent[i]) and text.startswith(self.sent[i]):
        out.append(self.event(i, text[len(self.sent[i]):], None))
      out.append(self.event(i, None, reason))
      self.done.add(i)
    return out

  async def run(self, disconnected: Callable[[], Any], path: str, t0: float):
    """The event stream; the jobs are cancelled when it ends however it ends (finished ones ignore it; queued
    ones of a client that left are dropped)."""
    metrics, timeout_s = self.service.metrics, self.service.cfg.timeout_s
    remaining, deadline = self.n_prompts, time.monotonic() + timeout_s
    try:
      if self.chat:
        for i in range(len(self.sent)):
          yield self.event(i, None, None, first=True)
      while remaining:
        if await disconnected():
          return
        if time.monotonic() > deadline:
          metrics.request(path, 504)
          yield self.error_event(504, f"the request did not finish within {timeout_s:g}s", "timeout_error")
          return
        try:
          kind, k, payload = await asyncio.wait_for(self.events.get(), 0.05)
        except asyncio.TimeoutError:
          continue
        if kind == "tokens":
          for e in self.on_tokens(k, payload):
            yield e
          continue
        remaining -= 1
        if isinstance(payload, BaseException):
          metrics.request(path, 500)
          yield self.error_event(500, f"generation failed: {type(payload).__name__}: {payload}", "server_error")
          return
        for e in self.on_done(k, payload):
          yield e
      yield "data: [DONE]\n\n"
      metrics.request(path, 200, time.perf_counter() - t0)
    finally:
      for j, _ in self.jobs:
        j.cancel()


# ----------------------------------------------------------------------------- HTTP

async def _invalid(request: Request, exc: RequestValidationError):
  errs = exc.errors()
  first = errs[0] if errs else {}
  loc = [str(x) for x in first.get("loc", ()) if x != "body"]
  msg = first.get("msg", "invalid request")
  if first.get("type") == "json_invalid":
    msg = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', msg)})"
    loc = []  # the location is a character offset, not a parameter
  elif loc:
    msg = f"{'.'.join(loc)}: {msg}"
  request.app.state.service.metrics.request(request.url.path, 400)
  return error_response(400, msg, param=".".join(loc) or None)


async def _http(request: Request, exc: StarletteHTTPException):  # unknown routes, wrong methods, bad bodies
  request.app.state.service.metrics.request(request.url.path, exc.status_code)
  text = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
  msg = text.get(exc.status_code) or (
      "the request body could not be parsed (not UTF-8 JSON, or nested too deeply)" if exc.status_code == 400
      else str(exc.detail))
  return error_response(exc.status_code, msg, "not_found_error" if exc.status_code == 404 else "invalid_request_error")


async def _api_error(request: Request, exc: APIError):
  request.app.state.service.metrics.request(request.url.path, exc.status)
  return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)


async def _unexpected(request: Request, exc: Exception):  # never a bare 500 page or a dead server
  request.app.state.service.metrics.request(request.url.path, 500)
  return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _auth_middleware(api_key: str):
  want = f"Bearer {api_key}".encode()

  async def auth(request: Request, call_next):
    if request.url.path.startswith("/v1/") and not hmac.compare_digest(
        request.headers.get("authorization", "").encode(), want):
      request.app.state.service.metrics.request(request.url.path, 401)
      return error_response(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                            "invalid_request_error", code="invalid_api_key")
    return await call_next(request)
  return auth


def host_name(header: str) -> str:
  """The host of a Host header: without its port, an IPv6 address without brackets, lower case."""
  h = header.strip().lower()
  if h.startswith("["):
    return h[1:h.find("]")] if "]" in h else h
  return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def _host_middleware(allowed: tuple[str, ...]):
  names = {h.lower() for h in allowed}

  async def check_host(request: Request, call_next):
    if host_name(request.headers.get("host", "")) not in names:
      request.app.state.service.metrics.request(request.url.path, 400)
      return error_response(400, f"Host {request.headers.get('host', '')!r} is not one this server answers "
                                 "(serve --allowed-hosts)", "invalid_request_error", code="invalid_host")
    return await call_next(request)
  return check_host


def create_app(model, batcher: Batcher, metrics: Metrics, cfg: ServerConfig) -> FastAPI:
  """The FastAPI app: routes that hand each request to a Service (app.state.service)."""
  # No /docs, /redoc or /openapi.json: the API is OpenAI's, and the schema is not for anyone who connects.
  app = FastAPI(title="dinfer-jax", docs_url=None, redoc_url=None, openapi_url=None)
  app.add_middleware(_BodyLimit, limit=cfg.max_body_bytes)
  if cfg.allowed_hosts is not None:
    app.middleware("http")(_host_middleware(cfg.allowed_hosts))
  if cfg.api_key:
    app.middleware("http")(_auth_middleware(cfg.api_key))
  svc = app.state.service = Service(model, batcher, metrics, cfg)
  for exc, handler in ((RequestValidationError, _invalid), (StarletteHTTPException, _http), (APIError, _api_error),
                       (Exception, _unexpected)):
    app.add_exception_handler(exc, handler)

  @app.get("/health")
  async def health():
    return {"status": "ok", "model": cfg.model_name, "queue_depth": batcher.depth}

  @app.get("/metrics")
  async def prom():
    return PlainTextResponse(metrics.render(), media_type=METRICS_CONTENT_TYPE)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                         "owned_by": "dinfer-jax"}]}

  @app.post("/v1/completions")
  async def completions(request: Request, req: CompletionRequest):
    # Tokenising a few MB takes a while: off the event loop, so /health and the other requests go on.
    prompts = await asyncio.to_thread(svc.completion_prompts, req.prompt)
    return await svc.serve(request, req, prompts, chat=False, param="prompt")

  @app.post("/v1/chat/completions")
  async def chat(request: Request, req: ChatRequest):
    ids = await asyncio.to_thread(svc.chat_prompt, req.messages)  # off the event loop, as completions
    return await svc.serve(request, req, [ids], chat=True, param="messages")

  metrics.routes = frozenset(r.path for r in app.routes)
  return app
