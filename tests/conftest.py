"""Tests run on CPU with 8 fake devices; this must happen before jax touches a backend."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

assert len(jax.devices()) == 8, "tests need 8 fake CPU devices (set before importing jax)"

# ---------------------------------------------------------------------------------------------
# The quick first check, `python -m pytest -m quick` (README): these files, and the tests
# marked `@pytest.mark.quick` elsewhere. CI runs everything.

import pytest  # noqa: E402

QUICK = ("test_model.py", "test_sharding.py", "test_cli.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in QUICK:
            item.add_marker(pytest.mark.quick)
