"""Test set-up: 8 fake CPU devices and a persistent compile cache, configured before JAX starts."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
# LLVM -O0 for the CPU programs compiled in the test processes: XLA's optimized HLO (sharding,
# collectives, buffer sizes) is the default build's (tests/test_layout_programs.py) and compiles
# in ~40% less time; the machine code differs (floats by rounding, ~3e-6 after 3 AdamW steps, on
# both sides of every in-process comparison). Tests that start `meshtron` drop XLA_FLAGS.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8"
                           + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402  (must follow the environment set-up above)

jax.config.update("jax_numpy_rank_promotion", "raise")
_CACHE = os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
