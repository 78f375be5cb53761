"""The GPU check's predictions from the committed roofline JSONs: the central figure and its range."""
from __future__ import annotations

from dinfer_jax.bench import gpu_check


def test_the_committed_h200_prediction_has_a_range_around_its_central_figure():
  preds = gpu_check.load_predictions(sorted(gpu_check.PREDICTED_DIR.glob("h200_dinfer.json")))
  pred = gpu_check.predicted(preds, "llada_moe_7b_a1b", "dinfer", 1, chip="NVIDIA H200")
  assert pred is not None and set(pred["cases"]) == {"slow", "fast"}
  # A 1024-token generation at TPF 3.87: 16 block entries, 249 cached steps.
  central = gpu_check.predicted_generate_s(pred, 16, 249, 16)["realistic_s"]
  slow, fast = (gpu_check.predicted_generate_s(pred["cases"][c], 16, 249, 16)["realistic_s"] for c in ("slow", "fast"))
  assert fast < central < slow
