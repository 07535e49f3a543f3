"""Tests run on CPU with 8 fake devices; this must happen before jax touches a backend."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

assert len(jax.devices()) == 8, "tests need 8 fake CPU devices (set before importing jax)"

# ---------------------------------------------------------------------------------------------
# Helpers shared by the test modules (`from tests.conftest import ...`).

import dataclasses  # noqa: E402
import socket  # noqa: E402

from flax import nnx  # noqa: E402

import ladder_jax as lj  # noqa: E402

TINY = lj.ModelConfig.from_preset("tiny")
SCHEMES = {  # every valid scheme, hybrid included
    "standard": dict(residual="standard"),
    "parallel": dict(residual="parallel"),
    "ladder": dict(residual="ladder"),
    "hybrid": dict(residual="ladder", ladder_layers=2),
}


def mesh(tp, data=1):
    """A data x tp mesh over the first tp * data fake devices."""
    return lj.make_mesh(tp=tp, data=data, devices=jax.devices()[: tp * data])


def tiny_model(tp=1, seed=0, **changes):
    """The tiny preset with `changes`, on a tp mesh."""
    return lj.Transformer(dataclasses.replace(TINY, **changes), mesh=mesh(tp),
                          rngs=nnx.Rngs(seed))


@nnx.jit
def logits(model, tokens):
    return model(tokens)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# The quick first check, `python -m pytest -m quick` (README): these files, and the tests
# marked `@pytest.mark.quick` elsewhere. CI runs everything.

import pytest  # noqa: E402

QUICK = ("test_model.py", "test_sharding.py", "test_cli.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in QUICK:
            item.add_marker(pytest.mark.quick)
