"""Test setup: eight simulated CPU devices (for the sharding tests) and XLA:CPU's codegen
level before JAX starts, and hypothesis' example counts (few and fixed by default, more and fresh
under `make test-all`)."""

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

# make test / test-extra (CI) draw the same few examples every run (derandomize: a CI run cannot fail on
# a draw the previous one did not make); make test-all draws 50 fresh ones each run, the exploring leg
# (it found the float8 subnormal bound, tests/test_quant_bound.py).
settings.register_profile("default", max_examples=6, derandomize=True)
settings.register_profile("all", max_examples=50)
settings.load_profile(os.environ.get("FLEXJAX_HYPOTHESIS", "default"))


# make test's 5-minute budget on 2 cores (it reached 4:47 on 2026-12-06): these variants run in
# make test-extra (ci_extra) instead. Each has a sibling that stays in make test: the same test on
# another backend, entry, shape or dtype (pallas_tpu's interpreter is pallas' kernel code with the
# TPU tiling; xla's and reference's low-precision entries stay).
MOVED_TO_CI_EXTRA = {
    "tests/conformance.py::test_catalog[pallas-document+t5]",
    "tests/conformance.py::test_catalog[pallas-per_head_mask+relative_bias]",
    "tests/conformance.py::test_low_precision[pallas-bfloat16-causal+soft_cap]",
    "tests/conformance.py::test_captured_row_and_column_grads[pallas_tpu]",
    "tests/conformance.py::test_heads[pallas_tpu-mha]",
    "tests/conformance.py::test_heads[pallas_tpu-mqa]",
    "tests/conformance.py::test_max_and_min_scores[pallas_tpu]",
    "tests/conformance.py::test_fully_masked_rows_are_zero_with_finite_grads[pallas_tpu]",
    "tests/conformance.py::test_tile_options[pallas-split]",
    "tests/test_xla.py::test_catalog_float32[padding_zero_length-gqa_unequal]",
    "tests/test_xla.py::test_catalog_float32[fully_masked_rows-mha]",
    "tests/test_xla.py::test_catalog_low_precision[prefix_lm+relative_bias-f16]",
    "tests/test_drop_in.py::test_matches_jax_nn_on_reference[everything]",
    "tests/test_sparse.py::test_nsa_scores_match_numpy[shape1-block1-True-False-lengths1]",
    "tests/test_sparse.py::test_moba_scores_match_numpy[shape1-block1-True-False]",
    "tests/test_from_kv_blocks.py::test_matches_dense_attention_with_the_implied_mask[causal_full_padded-reference]",
    "tests/test_block_mask_widths.py::test_every_builder_path_matches_enumeration[stripes]",
    "tests/test_paged.py::test_paged_matches_gathered_cache[1-kernel]",
    "tests/conformance.py::test_deterministic[pallas]",
    "tests/test_jit_sharding.py::test_jit_and_grad_match_one_device[auto-heads-relative_bias]",
    # (conformance's test_max_and_min_scores and the return_lse tests stay)
    "tests/test_training_features.py::test_max_scores_and_lse_aux[xla]",
    # (test_flax.py's test_batch_axes_and_refusals stays)
    "tests/test_flax.py::test_flex_layer_refusals",
}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.nodeid in MOVED_TO_CI_EXTRA:
            item.add_marker(pytest.mark.ci_extra)
