"""The GPU check's reading of XLA's thunk sequence (bench.gpu_check.loop_thunks): which loops became CUDA-graph
conditionals. Hand-written sequences in the dump's format (`N: kKind ...`, nested thunks indented)."""
from __future__ import annotations

from dinfer_jax.bench import gpu_check

_CONVERTED = """000: kKernel kernel=loop_fusion
001: kCommandBuffer
  000: kKernel kernel=fusion.1
  001: kWhile
    000: kKernel kernel=body_fusion
    001: kConditional
      000: kKernel kernel=branch_a
002: kKernel kernel=copy
"""

_HOST = """000: kKernel kernel=loop_fusion
001: kWhile
  000: kCommandBuffer
    000: kKernel kernel=body_fusion
  001: kConditional
    000: kKernel kernel=branch_a
  002: kWhile
    000: kKernel kernel=step
"""


def test_loops_inside_a_command_buffer_are_graph_loops():
  assert gpu_check.loop_thunks(_CONVERTED) == {"host_whiles": 0, "host_conditionals": 0, "graph_whiles": 1,
                                               "graph_conditionals": 1, "command_buffers": 1}
  line = gpu_check.command_buffer_line(dict(gpu_check.loop_thunks(_CONVERTED), found=True, file="m.txt",
                                            after_passes=True))
  assert "0 host syncs per step" in line


def test_loops_the_host_drives_are_counted_as_such():
  # The body's kernels are captured (a command buffer of its own), but the loops around them stay host-driven.
  assert gpu_check.loop_thunks(_HOST) == {"host_whiles": 2, "host_conditionals": 1, "graph_whiles": 0,
                                          "graph_conditionals": 0, "command_buffers": 1}
  line = gpu_check.command_buffer_line(dict(gpu_check.loop_thunks(_HOST), found=True, file="m.txt",
                                            after_passes=False))
  assert "2 while(s) and 1 conditional(s) left to the host" in line


def test_a_dump_without_a_thunk_sequence_says_so(tmp_path):
  (tmp_path / "module_0001.jit_run.before_optimizations.txt").write_text("HloModule m")
  cb = gpu_check.command_buffers(tmp_path)
  assert cb["found"] is False and "no thunk sequence" in cb["why"]
  (tmp_path / "module_0002.jit_run.thunk_sequence.txt").write_text(_CONVERTED)
  (tmp_path / "module_0002.jit_run.thunk_sequence_after_thunk_passes.txt").write_text(_CONVERTED)
  keep = tmp_path / "kept.txt"
  cb = gpu_check.command_buffers(tmp_path, keep=keep)
  assert cb["found"] and cb["after_passes"] and cb["graph_whiles"] == 1 and keep.read_text() == _CONVERTED
