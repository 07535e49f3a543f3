"""Tests run on CPU with 8 fake devices; this must happen before jax touches a backend."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402

assert len(jax.devices()) == 8, "tests need 8 fake CPU devices (set before importing jax)"

# The processes the tests start (command-line runs, servers, notebook kernels) share one XLA
# compilation cache for the session, so a program one of them compiled is loaded by the next.
# Set after `import jax`: this process compiles as it did (its compile-behaviour tests see that).
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

_XLA_CACHE = tempfile.mkdtemp(prefix="ladder-jax-tests-xla-")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _XLA_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# ---------------------------------------------------------------------------------------------
# The quick first check, `python -m pytest -m quick` (README): these files, and the tests
# marked `@pytest.mark.quick` elsewhere. CI runs everything.

import pytest  # noqa: E402

QUICK = ("test_model.py", "test_sharding.py", "test_cli.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in QUICK:
            item.add_marker(pytest.mark.quick)
