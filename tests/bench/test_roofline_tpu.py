"""The roofline bench's deviceless TPU compile (libtpu; `pip install -e ".[tpu]"`). Skipped without libtpu,
which CI does not install (about 700 MB): run it with the tpu extra installed."""
from __future__ import annotations

import pytest

from dinfer_jax import hardware
from dinfer_jax.bench import realistic, roofline

pytestmark = pytest.mark.skipif(not roofline.libtpu_available(), reason="libtpu not installed (pip install -e '.[tpu]')")


def test_tiny_preset_compiles_for_a_v6e_chip():
  """The generate program and the forwards compile for a v6e without one: the XLA kernels the engine picks on
  a TPU (no Pallas-Triton: dense MoE at the tiny preset's token counts, XLA attention), the loop on the chip
  (no host syncs), the spec peaks as the ideal charges and the chip's HBM in the rows."""
  res = roofline.run("tiny", ["v6e"], [1], ["dual"], "cpu", progress=None)
  assert res["label"] == "deviceless TPU compile"
  rows = {r["kind"]: r for r in res["rows"]}
  assert set(rows) == {"refresh", "cached", "generate"}
  assert all(r["chip"] == hardware.TPUS["v6e"].name for r in res["rows"])
  assert rows["generate"]["device_loop"] and rows["generate"]["host_syncs_per_step"] == 0
  assert rows["cached"]["moe_impl"] == "dense" and rows["cached"]["kernel_calls"] == 0  # no Pallas-Triton
  ideal = roofline.roofline_s(hardware.TPUS["v6e"], rows["cached"]["flops"], rows["cached"]["bytes"])
  assert rows["cached"]["roofline_ms"] == pytest.approx(1e3 * ideal)
  # XLA TPU's own roofline of the program, where it gives one (a non-positive value is none).
  assert rows["cached"].get("compiler_optimal_ms", 1.0) > 0
  lo, hi = res["realistic_tps_batch1_range"]
  assert lo < res["realistic_tps_batch1"] < hi
  assert realistic.CHARGES["v6e"].sync_us == 0 and realistic.CHARGES["v6e"].hbm_bytes_per_s < 1638e9


def test_tpu_and_gpu_chips_do_not_mix_targets():
  with pytest.raises(ValueError, match="not one"):
    roofline.Target("tpu", hardware.CHIPS["h200"])
  with pytest.raises(ValueError, match="not one"):
    roofline.Target("cpu", hardware.TPUS["v6e"])


def test_a_v6e_slice_compiles_the_sharded_forward():
  """A 2 x 2 v6e slice as a tensor x expert mesh (bench.mesh_compile): the cached forward compiles with the
  collectives XLA inserts for it, charged at half the chip's bidirectional inter-chip bandwidth."""
  from dinfer_jax.bench import mesh_compile, presets
  mesh = mesh_compile.topology_mesh({"tensor": 2, "expert": 2}, "v6e")
  assert mesh.size == 4 and all(d.platform == "tpu" for d in mesh.devices.flat)
  a = mesh_compile.analyse(mesh_compile.compile_forward(presets.get("tiny").model(), mesh, 1, "cached"), 4, "v6e")
  assert a["collectives"] and a["t_collectives_s"] > 0 and a["kernels"] > 0
  link = hardware.TPUS["v6e"].ici_bytes_per_s / 2
  assert a["t_collectives_s"] == pytest.approx(mesh_compile.collective_seconds(a["collectives"], 4, link))
  assert a["t_realistic_s"] > a["t_forward_s"]  # the per-op floors and achievable fractions
  with pytest.raises(ValueError, match="mesh of 3 v6e chips"):
    mesh_compile.topology_mesh({"tensor": 3}, "v6e")


def test_a_v6e_slice_compiles_the_generate_program_per_chip():
  """The roofline bench on a 4-chip slice (tensor=2 x expert=2): the generate program and its forwards compile
  with the weights split by the rules table (each chip holds less than the whole model), its collectives
  are charged over the links, the loop stays on the chips, and the JSON has the one-chip file's fields."""
  one = roofline.run("tiny", ["v6e"], [1], ["dual"], "cpu", progress=None)
  res = roofline.run("tiny", ["v6e-4"], [1], ["dual"], "cpu", progress=None, mesh={"tensor": 2, "expert": 2})
  rows = {r["kind"]: r for r in res["rows"]}
  whole = {r["kind"]: r for r in one["rows"]}
  assert rows["cached"]["chip"] == "TPU v6 lite x4 (tensor=2,expert=2)"
  assert rows["cached"]["argument_bytes"] < whole["cached"]["argument_bytes"]
  assert rows["cached"]["class_ms"]["collective"] > 0 and "collective" not in whole["cached"]["class_ms"]
  assert rows["generate"]["device_loop"] and rows["generate"]["host_syncs_per_step"] == 0
  assert res["charges"]["v6e-4"]["link_bytes_per_s"] == hardware.TPUS["v6e"].ici_bytes_per_s / 2
  assert set(res) == set(one) and res["realistic_tps_batch1"] > 0
  with pytest.raises(ValueError, match="4 chips for --chips v6e-8"):
    roofline.run("tiny", ["v6e-8"], [1], ["dual"], "cpu", progress=None, mesh={"tensor": 4})


def test_a_two_host_v5e_slice_is_laid_out_by_its_links_and_compiles():
  """A v5e-8 slice spans two hosts of four chips. sharding.make_mesh (the engine's mesh, and the bench's) lays
  a whole TPU slice out by chip coordinates as jax's mesh_utils does, so a tensor group is a ring of ICI
  neighbours that crosses the hosts; the sharded forward compiles for it with collectives over all 8 chips."""
  from jax.experimental import mesh_utils

  from dinfer_jax import sharding
  from dinfer_jax.bench import mesh_compile, presets
  mesh = roofline.tpu_mesh("v5e", {"tensor": 4, "expert": 2})
  devices = list(mesh.devices.flat)
  assert sorted({d.process_index for d in devices}) == [0, 1]
  expected = mesh_utils.create_device_mesh((1, 4, 2), devices, allow_split_physical_axes=True)
  assert [d.id for d in mesh.devices.flat] == [d.id for d in expected.flat]
  ordered = sharding.make_mesh(tensor=4, expert=2, devices=sorted(devices, key=lambda d: -d.id))
  assert [d.id for d in ordered.devices.flat] == [d.id for d in mesh.devices.flat]  # not the list's order
  a = mesh_compile.analyse(mesh_compile.compile_forward(presets.get("tiny").model(), mesh, 1, "cached"), 8, "v5e")
  assert a["collectives"] and a["t_collectives_s"] > 0
