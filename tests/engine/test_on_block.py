"""generate(..., on_block=...): the engine hands each committed block to the host while its program runs,
and streaming changes nothing in the result."""
import pytest

import dinfer_jax
from dinfer_jax import cli_common


@pytest.fixture(scope="module")
def model(default_model):
  return default_model


def test_on_block_streams_each_committed_block(model, default_gcfg):
  gcfg = default_gcfg.replace(block_length=4)  # two blocks (the model's own default is one block of 8)
  ids = cli_common.encode_prompts(model, ["What is 348+279?", "f(0..5)=2,5,8,11,14,17", "f(0..5)=1,3,5,7,9,11"])
  seen = []
  res = dinfer_jax.generate(model, ids, gcfg, batch_bucket=4, on_block=lambda k, rows: seen.append((k, rows)))
  plain = dinfer_jax.generate(model, ids, gcfg, batch_bucket=4)
  assert (res.tokens, res.canvas, res.commit_step, res.nfe, res.row_nfe) == \
      (plain.tokens, plain.canvas, plain.commit_step, plain.nfe, plain.row_nfe)
  assert [k for k, _ in seen] == list(range(gcfg.gen_length // gcfg.block_length))  # block order, every block
  for r in range(len(ids)):
    grown = [rows[r] for _, rows in seen]
    assert grown[-1] == res.tokens[r]
    assert all(b[:len(a)] == a for a, b in zip(grown, grown[1:]))
  # After block 0 the program answer "x*3+2" was half written: the callback saw the program mid-run.
  assert model.tokenizer.decode(seen[0][1][1]) == "x*3+" and model.tokenizer.decode(seen[1][1][1]) == "x*3+2"
