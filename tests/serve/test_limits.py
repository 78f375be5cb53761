"""The server's limits in process (no engine call runs: the batcher's worker is never started): a full
queue answers 429, a request past its timeout 504 (and is dropped from the queue), both OpenAI-style."""
import asyncio

import pytest

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
