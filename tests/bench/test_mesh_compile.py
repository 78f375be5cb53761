"""The pieces of the deviceless mesh compile that need no GPU plugin: HLO collective parsing, the collective
time model and the TPS model, against hand-worked numbers."""
import pytest

from dinfer_jax.bench import mesh_compile as mc

HLO = """
ENTRY %main (p: bf16[64,2048]) -> (bf16[64,2048]) {
  %p = bf16[64,2048]{1,0} parameter(0)
  %all-reduce-start = bf16[64,2048]{1,0} all-reduce-start(%p), channel_id=1, to_apply=%add
  %all-reduce-done = bf16[64,2048]{1,0} all-reduce-done(%all-reduce-start)
  %ar2 = f32[8,16]{1,0} all-reduce(%x), channel_id=2, to_apply=%add
  %ag = (bf16[4,16]{1,0}, bf16[32,16]{1,0}) all-gather-start(%y), channel_id=3, dimensions={0}
  %ag.done = bf16[32,16]{1,0} all-gather-done(%ag)
  ROOT %t = (bf16[64,2048]{1,0}) tuple(%all-reduce-done)
}
"""


def test_collectives_counts_async_pairs_once_with_result_bytes():
  c = mc.collectives(HLO)
  assert c == {"all-reduce": {"count": 2, "bytes": 64 * 2048 * 2 + 8 * 16 * 4},
               "all-gather": {"count": 1, "bytes": 32 * 16 * 2}}


def test_collective_seconds_ring_model():
  c = {"all-reduce": {"count": 2, "bytes": 8 * 10**6}, "all-gather": {"count": 1, "bytes": 10**6}}
  want = 2 * 7 / 8 * 8e6 / mc.NVLINK_BW + 7 / 8 * 1e6 / mc.NVLINK_BW + 3 * mc.COLLECTIVE_LATENCY
  assert mc.collective_seconds(c, 8) == pytest.approx(want)


def test_predicted_tps_one_refresh_per_block():
  # TPF 4 on a 64-token block: 16 forwards, one of them the refresh.
  per_seq, agg = mc.predicted_tps(t_refresh=0.010, t_cached=0.002, batch=32, tpf=4.0)
  assert per_seq == pytest.approx(64 / (0.010 + 15 * 0.002))
  assert agg == pytest.approx(32 * per_seq)
