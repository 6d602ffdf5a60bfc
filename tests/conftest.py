"""Test setup: eight simulated CPU devices (for the sharding tests) before JAX starts, and
hypothesis' example counts (few by default, more under `make test-all`)."""

import os

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

from hypothesis import settings  # noqa: E402

settings.register_profile("default", max_examples=6)
settings.register_profile("all", max_examples=50)
settings.load_profile(os.environ.get("FLEXJAX_HYPOTHESIS", "default"))
