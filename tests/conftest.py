"""Test setup: eight simulated CPU devices (for the sharding tests) and XLA:CPU's codegen
level before JAX starts, and hypothesis' example counts (few by default, more under `make
test-all`)."""

import os

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
# XLA:CPU's LLVM at -O0: the suite's programs are small and compile far more than they run
# (the default suite took 29% less time on test_xla.py and test_api.py). Numerics are XLA's
# own either way; set the flag yourself to test at another level.
if "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = flags.strip()
# Mosaic GPU's interpreter (the mosaic_gpu backend on a CPU host) runs each simulated warpgroup
# as an XLA:CPU computation whose barrier waits block a thread of XLA:CPU's pool, which XLA sizes
# by the machine's cores (NPROC overrides): with 2 cores the three warpgroups of a kernel starve it
# and hang. Set before JAX starts its CPU client.
os.environ.setdefault("NPROC", "16")

import importlib.util  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# The triton-marked tests (make test-compile's venv has Triton, jax-triton and torch):
# jax_triton sets TRITON_CACHE_DIR="" when imported (it compiles without Triton's cache),
# which makes a later triton.compile in the same process fail ("Could not create or locate
# cache dir"); the codegen tests compile with triton.compile, so import it first and give
# Triton its default cache back.
if importlib.util.find_spec("jax_triton") is not None:
    _cache_dir = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton  # noqa: F401
    except ImportError:
        pass
    if _cache_dir is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = _cache_dir

settings.register_profile("default", max_examples=6)
settings.register_profile("all", max_examples=50)
settings.load_profile(os.environ.get("FLEXJAX_HYPOTHESIS", "default"))


# make test's 5-minute budget: these default tests (3-9 s each) run in CI through `make test-extra`
# instead (the ci_extra marker, given here only). Each has cheaper siblings in make test: other
# cases of the same test, or the same feature's other tests.
CI_EXTRA = frozenset({
    "tests/test_multiprocess.py::test_two_processes_match_one_process",
    "tests/test_bare_install.py::test_entry_points_without_optional_packages",
    "tests/test_cli_demo.py::test_demo_small",
    "tests/test_flax.py::test_nnx_outputs_and_grads_match_flax",
    "tests/test_block_mask_analysis.py::test_analysis_matches_enumeration",
    "tests/test_training_features.py::test_sinks_forward_and_grads[xla-one_sink]",
    "tests/test_decode.py::test_pallas_packs_gqa_rows_of_mods_that_read_h[1]",
    "tests/test_captured_scalars.py::test_random_score_mods_compile_or_refuse",
    "tests/test_captured_scalars.py::test_random_mask_mods_compile_or_refuse",
    "tests/test_cpu_kernel.py::test_backward_prepares_q_do_and_delta_both_ways[per_tile]",
    "tests/test_cpu_kernel.py::test_decode_tiles_without_mods_pack_their_scores[bfloat16]",
    "tests/test_kernel_cache.py::test_failed_rebuild_runs_the_loops[kernel]",
    "tests/test_ragged.py::test_ragged_gradients[xla]",
    "tests/test_decode.py::test_decode_block_mask_matches_offset_mask[1]",
    "tests/test_decode.py::test_decode_path_matches_reference[3]",
    "tests/test_paged.py::test_sinks_and_aux_lse[xla]",
    "tests/test_ragged.py::test_write_and_attend_equals_write_then_attend[xla]",
    "tests/test_cpu_kernel.py::test_backward_kernel_runs_unless_captured_arrays_need_gradients",
    "tests/test_flax.py::test_flex_layer_paged_cache_shares_its_pool_and_raises_past_it",
    "tests/test_flax.py::test_flex_layer_under_remat",
    "tests/test_dropout_kernels.py::test_residuals",
    "tests/test_drop_in.py::test_matches_jax_nn_on_xla[everything]",
    "tests/test_api.py::test_check_grads_with_captured_table[xla]",
    "tests/test_block_mask_analysis.py::test_compact_lists_and_max_blocks_per_row",
    "tests/test_jit_sharding.py::test_jit_and_grad_match_one_device[explicit-batch_heads-relative_bias]",
    # (2026-12-06: 4:55 of tests with the float tail, explain and Flax storage tests added)
    "tests/test_mosaic_gpu.py::test_catalog_in_the_interpreter[default-sm_90a-sliding_window+alibi-small_gqa_ragged]",
    "tests/test_ragged.py::test_ragged_matches_per_sequence[xla-window-bfloat16]",
    "tests/test_training_features.py::test_dropout_is_the_same_for_every_tile_and_backend",
    "tests/test_exactness.py::test_float64_xla_matches_reference_on_the_catalog[document+t5]",
})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in CI_EXTRA:
            item.add_marker(pytest.mark.ci_extra)
