"""Peak host memory of the conversion on a generated ~0.5 GB checkpoint (slow; convert/measure_memory.py)."""
import pytest


@pytest.mark.slow
def test_hf2jax_peak_memory_is_about_one_leaf(tmp_path):
  from convert import measure_memory
  r = measure_memory.measure(0.5, tmp_path / "w")
  print(measure_memory.report(r))
  m, steps = r["model"], r["steps"]
  base = steps["baseline (import jax, orbax, converter)"]["peak_rss"]
  extra = steps["hf2jax bf16"]["peak_rss"] - base
  # One stacked param leaf plus the HF tensor being copied, plus slack; far below the model itself.
  assert extra < m["largest_leaf_bytes"] + m["largest_tensor_bytes"] + 96 * 2**20, (extra, m)
  assert extra < 0.6 * m["model_bytes"], (extra, m)
  f32 = steps["hf2jax f32"]["peak_rss"] - base
  assert f32 < 2 * m["largest_leaf_bytes"] + m["largest_tensor_bytes"] + 96 * 2**20, (f32, m)
