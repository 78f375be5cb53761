"""Test setup: 8 fake CPU devices for sharding tests, full-precision matmuls for numerics."""
import os
import shutil
import tempfile

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI's compilation cache (--compile-cache, default under $XDG_CACHE_HOME) goes to one directory per
# test run, shared by the xdist workers and the CLI subprocesses, never the user's own cache.
# (The controller imports this first; its workers inherit the variable.)
_RUN_CACHE = os.environ.setdefault("DINFER_JAX_TEST_CACHE",
                                   os.path.join(tempfile.gettempdir(), f"dinfer-jax-tests-{os.getpid()}"))
os.environ["XDG_CACHE_HOME"] = _RUN_CACHE

import jax  # noqa: E402

# Numerics tests compare against fp32 references; the CPU default is already fp32, but be explicit.
jax.config.update("jax_default_matmul_precision", "highest")

# The run's compilation cache from the start (the CLI tests would switch a worker to it anyway): the two
# xdist workers compile many of the same programs (the default model's, the golden models'), and the second
# one loads them from disk.
from dinfer_jax.engine.programs import enable_disk_cache  # noqa: E402

enable_disk_cache(None)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model():
  """The embedded default model (dinfer_jax.load("default")), loaded once per session."""
  import dinfer_jax
  return dinfer_jax.load("default")


@pytest.fixture(scope="session")
def default_gcfg(default_model):
  """The generation config `dinfer-jax generate` uses for the embedded model (its generation_config.json)."""
  from dinfer_jax import cli, cli_common
  return cli_common.generation_config(cli.build_parser().parse_args(["generate", "x"]), default_model.path)


def pytest_sessionfinish(session, exitstatus):
  if not hasattr(session.config, "workerinput"):  # the controller, after every worker is done
    shutil.rmtree(_RUN_CACHE, ignore_errors=True)


# Slow cases: the default run (`-m 'not slow'`, < 10 min on the 2-core machine) keeps one or two cases of
# each parametrized family and leaves these to `pytest -m slow`; each took 10-40 s there (2026-12-03).
# The multi-process, sharded-training, lm-eval and mixed-pool serving tests are among them: run
# `pytest -m slow` (about 25 min) before changing those parts.
SLOW_CASES = (
    # The whole forward on the GPU grouped kernels in the interpreter (24 s): the MoE layer's kernel-vs-
    # reference test keeps the kernels in the default run.
    "tests/model/test_grouped_gemm.py::test_forward_on_the_grouped_kernels_matches_the_dense_forward",
    # The TPU grouped GEMM in the interpreter: the multi-tile case stays (and the MoE-vs-loop test).
    "tests/model/test_grouped_gemm_tpu.py::test_gmm_matches_ragged_dot[300-256-256-5-128]",
    "tests/model/test_grouped_gemm_tpu.py::test_gmm_matches_ragged_dot[40-128-128-64-128]",
    # "+a8g" through the grouped kernels: int8 keeps the path and the outlier claim in the default run.
    "tests/model/test_grouped_gemm.py::test_grouped_kernels_with_a_scale_per_128_columns[fp8]",
    "tests/model/test_quant.py::test_a8g_einsum_rounds_each_run_of_128[fp8]",
    "tests/bench/test_bench.py::test_gpu_check_rehearsal_on_cpu",  # gpu_check.sh's rehearsal covers batch 1
    "tests/engine/test_engine_vs_reference.py::test_prefix_windows_shrink_batch3",
    "tests/engine/test_engine_vs_reference.py::test_batch3_rows_equal_reference[threshold-prefix-plain]",
    "tests/engine/test_engine_vs_reference.py::test_batch3_rows_equal_reference[threshold-vicinity-plain]",
    "tests/engine/test_engine_vs_reference.py::test_batch3_rows_equal_reference[threshold-none-plain]",
    "tests/engine/test_engine_vs_reference.py::test_batch3_rows_equal_reference[hierarchy-dual-smooth]",
    "tests/engine/test_engine_vs_reference.py::test_dense_batch3_rows_equal_reference[hierarchy-dual-plain]",
    "tests/engine/test_engine_vs_reference.py::test_llada2_block_diffusion_rows_equal_reference[threshold-prefix]",
    "tests/engine/test_golden_traces.py::test_engine_without_idle_forwards_matches_trace[dense/c_thr0.9_prefix/p2]",
    "tests/sharding/test_sharded_generate.py::test_sharded_generate_equals_single_device[d2t4-fastdllm_dual_vicinity_smoothing]",
    "tests/sharding/test_sharded_generate.py::test_sharded_generate_equals_single_device[t2e4-fixed_steps_dual]",
    "tests/sharding/test_sharded_generate.py::test_sharded_generate_equals_single_device[e4-credit_none_sampled]",
    "tests/sharding/test_sharded_train.py::test_sharded_step_equals_single_device[d8-mdm_dense]",
    "tests/model/test_moe_and_shapes.py::test_expert_kernels_match_loop_reference[dense-llada2_moe]",
    "tests/train_td/test_memory_options.py::test_bf16_compute_keeps_fp32_master_weights",
    "tests/train_td/test_trainer.py::test_ragged_training_kernel_matches_dense",
    "tests/train_td/test_trainer.py::test_deterministic_runs",
    "tests/train_td/test_trainer.py::test_export_load_round_trip[bfloat16]",
    "tests/train_td/test_trainer.py::test_killed_run_resumes_without_duplicate_metrics",
    "tests/tasks/test_jsonl.py::test_td_run_and_export_on_a_dense_llada_base",
    "tests/tasks/test_jsonl.py::test_jsonl_math_task_through_the_chat_template_matches_the_builtin_task",
    "tests/convert/test_convert_cli.py::test_refuses_existing_dst",
    "tests/evaluation/test_lm_eval.py::test_offline_lm_eval_scores_what_train_td_eval_scores",
    "tests/engine/test_engine_vs_reference.py::test_batch1_equals_reference[threshold-prefix-smooth]",
    "tests/model/test_moe_and_shapes.py::test_expert_kernels_match_loop_reference[ragged-llada2_moe]",
    "tests/model/test_layouts.py::test_attention_matches_reference[2]",
    "tests/sharding/test_multiprocess.py::test_generate_on_two_processes_equals_one",
    "tests/sharding/test_sharded_train.py::test_sharded_step_equals_single_device",
    "tests/bench/test_roofline.py::test_tiny_preset_cpu_target",
    "tests/bench/test_bench.py::test_bench_default_model",
    "tests/bench/test_bench.py::test_prefix_overhead_charges_each_window_width",
    "tests/train_td/test_memory_options.py::test_remat_gives_the_same_loss_and_gradients",
    "tests/train_td/test_trainer.py::test_train_refuses_a_directory_that_is_not_a_run",
    "tests/convert/test_convert_os_errors.py::test_relative_paths_from_another_directory",
    "tests/serve/test_continuous.py::test_staggered_mixed_lengths_equal_single_runs",
    "tests/test_notebooks.py::test_notebook_executes[02_generate_commit_order.ipynb]",
    # 2026-12-07, when the signal and GPU-check process tests joined the default run (29 s and ~10 s; the other
    # notebooks and the richer staggered-slots case stay):
    "tests/test_notebooks.py::test_notebook_executes[03_default_model_commit_order.ipynb]",
    "tests/engine/test_slots.py::test_staggered_rows_equal_their_prompt_alone[dual]",
    # 2026-12-07 (fifth session), when the suite took 723 s here (the two jsonl cases above had come back to the
    # default run when their file moved to tests/tasks; test_slow_cases.py now checks every name): one of two
    # models for 8-bit activations (tiny_llada_moe and the dense tiny_llada stay), fp8 generate (fp8+embed
    # stays), two of the sharded generate cases (eight others stay).
    "tests/model/test_quant.py::test_a8_forward_error_and_kernels[tiny_llada2_moe]",
    "tests/model/test_quant.py::test_quantised_generate_matches_dequantised_reference[fp8]",
    "tests/sharding/test_sharded_generate.py::test_sharded_generate_equals_single_device[t2-hierarchy_prefix_smoothing]",
    "tests/sharding/test_sharded_generate.py::test_sharded_generate_equals_single_device[d8-llada2_block_diffusion]",
    # ... and after a second run at 700 s: the one-device "mesh" case (the split meshes stay), the dense kernel
    # against the loop on llada_moe (test_quant's forward runs every kernel against it, test_llada2x dense and
    # ragged), and the smoothing schedule's D8 case (its no-smoothing side is a golden trace test).
    "tests/sharding/test_sharded_generate.py::test_sharded_generate_equals_single_device[1-threshold_dual_vicinity]",
    "tests/model/test_moe_and_shapes.py::test_expert_kernels_match_loop_reference[dense-llada_moe]",
    "tests/engine/test_engine_behaviour.py::test_skipping_the_owed_forward_moves_the_smoothing_schedule",
)


@pytest.hookimpl(tryfirst=True)  # before the -m selection reads the markers
def pytest_collection_modifyitems(config, items):
  for item in items:
    if item.nodeid in SLOW_CASES or item.nodeid.split("[")[0] in SLOW_CASES:
      item.add_marker(pytest.mark.slow)
