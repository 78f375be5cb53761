"""The server's parts without HTTP: request validation and configs, prompt encoding, answers, and the SSE
stream driven by hand-made engine events (no engine call runs: the batcher is a stand-in)."""
import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from dinfer_jax.serve.app import (APIError, ChatMessage, ChatRequest, CompletionRequest, ServerConfig,  # noqa: E402
                                  Service, SSEStream, unicode_text, usage)
from dinfer_jax.serve.batcher import Choice  # noqa: E402
from dinfer_jax.serve.metrics import Metrics  # noqa: E402


class FakeBatcher:
  """Takes jobs and answers nothing; validate refuses one prompt the way the engine would."""

  def __init__(self):
    self.jobs = []
    self.depth = 0
    self.max_queue = 4

  def validate(self, prompt, gcfg, n=1):
    if len(prompt) > 50:
      raise ValueError("generate: prompt 0 has 51 tokens; ... more than the model's max_position=64")

  def submit(self, job):
    self.jobs.append(job)
    return job


@pytest.fixture
def svc(default_model, default_gcfg):
  return Service(default_model, FakeBatcher(), Metrics(2), ServerConfig("default", default_gcfg))


def _err(fn, *args):
  with pytest.raises(APIError) as e:
    fn(*args)
  return e.value


def test_request_config_and_its_errors(svc, default_gcfg):
  req = CompletionRequest(model="default", prompt="x", max_tokens=4, temperature=0.5, stop=["\n"])
  g = svc.request_config(req, [1, 2, 3])
  assert g.temperature == 0.5 and g.gen_length >= 4 and g.threshold == default_gcfg.threshold
  e = _err(svc.request_config, CompletionRequest(model="other", prompt="x"), [1])
  assert (e.status, e.param, e.code) == (404, "model", "model_not_found")
  e = _err(svc.request_config, CompletionRequest(model="default", prompt="x", max_tokens=10**6), [1])
  assert e.status == 400 and e.param == "max_tokens" and "context" in e.message
  e = _err(svc.request_config, CompletionRequest(model="default", prompt="x", stop=["a", "b", "c", "d", "e"]), [1])
  assert e.param == "stop"
  e = _err(svc.check, list(range(51)), default_gcfg, req, "prompt")
  assert e.code == "context_length_exceeded" and not e.message.startswith("generate:")


def test_prompts_encoding_and_their_errors(svc, default_model):
  ids = svc.completion_prompts("<|user|>348+279<|assistant|>")
  assert ids == [default_model.tokenizer.encode("<|user|>348+279<|assistant|>", add_special_tokens=False)]
  assert svc.completion_prompts([5, 6]) == [[5, 6]] and svc.completion_prompts([[5], [6, 7]]) == [[5], [6, 7]]
  assert len(svc.completion_prompts(["a", "b"])) == 2
  assert "5 prompts in one request" in _err(svc.completion_prompts, ["a"] * 5).message
  for bad, text in (([], "a string"), ([[]], "empty prompt"), ([10**6], "outside the vocabulary"),
                    ([1, "a"], "a string")):
    assert text in _err(svc.completion_prompts, bad).message
  assert "surrogate" in _err(unicode_text, "a\ud800", "prompt").message
  chat = svc.chat_prompt([ChatMessage(role="user", content="What is 348+279?")])
  assert default_model.tokenizer.decode(chat, skip_special_tokens=False) == "<|user|>348+279<|assistant|>"


def test_finish_cuts_at_the_cap_then_the_stop(svc, default_model):
  tok = default_model.tokenizer
  ids = tok.encode(" 627", add_special_tokens=False)
  ch = Choice(tokens=ids, gen_length=8, row_nfe=3)
  # A completion keeps the continuation's whitespace; chat answers as the CLI prints (stripped).
  assert svc.finish(ch, CompletionRequest(model="default", prompt="x"), False) == (" 627", "stop", ids)
  assert svc.finish(ch, CompletionRequest(model="default", prompt="x"), True) == ("627", "stop", ids)
  text, reason, toks = svc.finish(ch, CompletionRequest(model="default", prompt="x", max_tokens=2), False)
  assert (text, reason, toks) == (tok.decode(ids[:2]), "length", ids[:2])
  assert svc.finish(ch, CompletionRequest(model="default", prompt="x", stop="2"), False)[:2] == (" 6", "stop")
  full = Choice(tokens=ids * 2, gen_length=len(ids) * 2, row_nfe=3)  # filled the canvas: no EOS
  assert svc.finish(full, CompletionRequest(model="default", prompt="x"), False)[1] == "length"
  assert usage(5, [(" 627", "stop", ids, 3)]) == {"prompt_tokens": 5, "completion_tokens": len(ids),
                                                    "total_tokens": 5 + len(ids)}
  body = svc.response(ChatRequest(model="default", messages=[ChatMessage(role="user", content="x")]), [[1, 2]],
                      [[ch]], True, "chatcmpl-1", 0)
  assert body["choices"][0]["message"]["content"] == "627" and body["dinfer"]["nfe"] == 3
  assert body["usage"]["prompt_tokens"] == 2 and body["object"] == "chat.completion"


def test_sse_stream_sends_settled_text_once_then_the_reason(svc, default_model):
  tok = default_model.tokenizer
  ids = tok.encode(" 627", add_special_tokens=False)
  req = ChatRequest(model="default", messages=[ChatMessage(role="user", content="x")], n=2, stream=True)
  events: asyncio.Queue = asyncio.Queue()
  cancelled = []

  class J:
    def cancel(self):
      cancelled.append(True)

  sse = SSEStream(svc, req, 1, True, "chatcmpl-1", 0, events, [(J(), None)])
  events.put_nowait(("tokens", 0, [ids[:1]]))  # greedy: one row serves both choices
  events.put_nowait(("tokens", 0, [ids[:1]]))  # nothing new: no event
  events.put_nowait(("done", 0, [Choice(ids, 8, 2), Choice(ids, 8, 2)]))

  async def collect():
    async def connected():
      return False
    return [e async for e in sse.run(connected, "/v1/chat/completions", 0.0)]

  out = asyncio.run(collect())
  assert out[-1] == "data: [DONE]\n\n" and cancelled == [True]
  chunks = [json.loads(e[len("data: "):]) for e in out[:-1]]
  assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
  texts = {i: "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == i)
           for i in (0, 1)}
  assert texts == {0: "627", 1: "627"}  # chat: the padding stripped, streamed or not
  reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
  assert reasons == ["stop", "stop"]
  # A failed job ends the stream with an error event.
  events2: asyncio.Queue = asyncio.Queue()
  events2.put_nowait(("done", 0, RuntimeError("boom")))
  sse2 = SSEStream(svc, CompletionRequest(model="default", prompt="x", stream=True), 1, False, "cmpl-1", 0,
                   events2, [])

  async def collect2():
    async def connected():
      return False
    return [e async for e in sse2.run(connected, "/v1/completions", 0.0)]
  out2 = asyncio.run(collect2())
  assert len(out2) == 1 and "boom" in json.loads(out2[0][len("data: "):])["error"]["message"]
