"""Peak host memory of the conversion on a generated ~0.5 GB checkpoint (slow; dinfer_jax/checkpoint/measure_memory.py)."""
import pytest


@pytest.mark.slow
def test_hf2jax_peak_memory_is_about_one_leaf(tmp_path):
  from dinfer_jax.checkpoint import measure_memory
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


@pytest.mark.slow
def test_load_onto_mesh_peak_memory_is_about_one_leaf(tmp_path):
  """dinfer_jax.load(path, mesh=...) places each leaf onto its sharding as it is read: beyond the placed
  shards themselves, host memory peaks at about one leaf (never the whole model first)."""
  from dinfer_jax.checkpoint import measure_memory
  r = measure_memory.measure_mesh_load(0.5, tmp_path / "w")
  m, steps = r["model"], r["steps"]
  base = steps["baseline (import, 8 devices, mesh)"]["peak_rss"]
  for name in ("load HF onto mesh", "load converted onto mesh"):
    s = steps[name]
    extra = s["peak_rss"] - base - s["resident"]
    print(f"{name}: transient {extra / 2**20:.0f} MiB, resident {s['resident'] / 2**20:.0f} MiB, "
          f"model {m['model_bytes'] / 2**20:.0f} MiB, largest leaf {m['largest_leaf_bytes'] / 2**20:.0f} MiB")
    assert s["resident"] >= m["model_bytes"] * 0.99, (name, s, m)  # the whole model really was placed
    assert extra < m["largest_leaf_bytes"] + m["largest_tensor_bytes"] + 96 * 2**20, (name, extra, m)
