"""Tests run on CPU with 8 fake devices; this must happen before jax touches a backend."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

assert len(jax.devices()) == 8, "tests need 8 fake CPU devices (set before importing jax)"
