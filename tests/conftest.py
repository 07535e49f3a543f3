"""Tests run on CPU with 8 fake devices; this must happen before jax touches a backend."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# Under pytest-xdist (`-n 2`) each worker inherits the controller's environment, shared cache
# below included: keep it out of this process's jax, as it is kept out of the controller's.
_SHARED = os.environ.get("LADDER_JAX_TESTS_XLA_CACHE")
if _SHARED and os.environ.get("JAX_COMPILATION_CACHE_DIR") == _SHARED:
    del os.environ["JAX_COMPILATION_CACHE_DIR"]

import jax  # noqa: E402

assert len(jax.devices()) == 8, "tests need 8 fake CPU devices (set before importing jax)"

# The processes the tests start (command-line runs, servers, notebook kernels) share one XLA
# compilation cache for the session, so a program one of them compiled is loaded by the next.
# Set after `import jax`: this process compiles as it did (its compile-behaviour tests see that).
# The session's first process (pytest's, or xdist's controller) makes it and removes it at exit;
# xdist's workers and their children use that one.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if not _SHARED:
    _SHARED = tempfile.mkdtemp(prefix="ladder-jax-tests-xla-")
    atexit.register(shutil.rmtree, _SHARED, ignore_errors=True)
    os.environ["LADDER_JAX_TESTS_XLA_CACHE"] = _SHARED
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _SHARED)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The commands' own cache (`ladder_jax.compile_cache`, on by default in the user's cache
# directory) stays off wherever a test drops the session's: no test writes to $HOME's cache
# (tests/test_compile_cache.py sets its own, in a temporary directory).
os.environ.setdefault("LADDER_COMPILE_CACHE", "off")

# ---------------------------------------------------------------------------------------------
# The quick first check, `python -m pytest -m quick` (README): these files, and the tests
# marked `@pytest.mark.quick` elsewhere. CI runs everything.

import collections  # noqa: E402

import pytest  # noqa: E402

QUICK = ("test_model.py", "test_sharding.py", "test_cli.py")
# Order of the files for `-n 2 --dist loadfile --no-loadscope-reorder`: the longest single
# tests first, so that a worker starts on them while the other works through the rest instead
# of one ending alone, then the files with the most tests (xdist's own default order).
FIRST = ("test_adaptation_smollm2.py",)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in QUICK:
            item.add_marker(pytest.mark.quick)
    per_file = collections.Counter(item.path.name for item in items)
    items.sort(key=lambda item: (item.path.name not in FIRST, -per_file[item.path.name]))
