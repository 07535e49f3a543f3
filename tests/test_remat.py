"""Activation rematerialization (`remat="module"`) changes memory, not maths: same loss and
gradients as `remat="none"` for every scheme and layout, smaller compiled temporaries."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ladder_jax as lj
from ladder_jax.analysis import overlap, programs
from ladder_jax.model import sharding
from ladder_jax.model.transformer import abstract
from ladder_jax.train import step
from tests.helpers import SCHEMES, TINY, loss_and_grads


@pytest.mark.parametrize(
    "layout",
    [(1, 2, False), (4, 2, False), (4, 2, True)],
    ids=["tp1-data2", "tp4-data2", "tp4-data2-fsdp"],
)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_remat_keeps_loss_and_gradients(scheme, layout):
    tp, data, fsdp = layout
    base = dataclasses.replace(TINY, **SCHEMES[scheme])
    loss0, grads0 = loss_and_grads(base, tp, data, fsdp)
    loss1, grads1 = loss_and_grads(dataclasses.replace(base, remat="module"), tp, data, fsdp)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads1, grads0
    )
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads0)) > 0


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_matmuls_remat_keeps_loss_and_gradients(scheme):
    # tp 2: the ladder's hand-written backward under the policy, its all-reduces included
    base = dataclasses.replace(TINY, **SCHEMES[scheme])
    loss0, grads0 = loss_and_grads(base, 2, 1)
    loss1, grads1 = loss_and_grads(dataclasses.replace(base, remat="matmuls"), 2, 1)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads1, grads0
    )
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads0)) > 0


def _gpu_temp_bytes(config, T=256):
    """Temporaries of the training step's gradient program compiled for one H100 (deviceless:
    XLA:CPU drops the barriers that keep a recomputation from being merged back into the
    forward, so the CPU program would not show what remat does on a GPU)."""
    gpu = programs.gpu_mesh("h100", 1)
    graphdef, params = abstract(config, gpu)
    tokens = jax.ShapeDtypeStruct((4, T), jnp.int32, sharding=NamedSharding(gpu, P()))
    fn = sharding.jit(lambda p, t: step.loss_and_grads(graphdef, p, t, t), platform="gpu")
    return fn.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("residual", ["standard", "ladder", "parallel"])
def test_remat_shrinks_compiled_temporaries(residual):
    # wide MLP and long sequence: the activations remat drops dominate the temporaries
    config = dataclasses.replace(TINY, residual=residual, d_ff=1024)
    none = _gpu_temp_bytes(config)
    module = _gpu_temp_bytes(dataclasses.replace(config, remat="module"))
    assert module < 0.5 * none, (module, none)


def _cpu_temp_bytes(config, T=256):
    """Temporaries of the gradient program on one CPU device (the package's CPU options)."""
    mesh = lj.make_mesh(tp=1, data=1, devices=jax.devices()[:1])
    graphdef, params = abstract(config, mesh)
    tokens = jax.ShapeDtypeStruct((4, T), jnp.int32, sharding=NamedSharding(mesh, P()))
    fn = sharding.jit(lambda p, t: step.loss_and_grads(graphdef, p, t, t), mesh=mesh)
    return fn.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("residual", ["standard", "ladder"])
def test_matmuls_remat_keeps_less_than_none_on_cpu(residual):
    # what the CPU recovery runs use: the scores and MLP activations are not kept
    config = dataclasses.replace(TINY, residual=residual, d_ff=1024)
    none, matmuls, module = (
        _cpu_temp_bytes(dataclasses.replace(config, remat=r)) for r in ("none", "matmuls", "module")
    )
    assert module < matmuls < 0.6 * none, (module, matmuls, none)


def test_unknown_remat_policy_is_refused():
    with pytest.raises(lj.ConfigError, match="remat='layers'.*none, module"):
        dataclasses.replace(TINY, remat="layers")


def test_ladder_backward_still_overlaps_with_remat():
    config = dataclasses.replace(TINY, residual="ladder", n_kv_heads=8, remat="module")
    rep = overlap.report(config, phase="train", tp=8, batch=1, seq=128)
    for pass_ in ("forward", "backward"):
        ars = [
            r for r in rep["all_reduces"] if r["pass"] == pass_ and r["kind"] in ("module", "head")
        ]
        assert len(ars) == 8 + (pass_ == "backward"), [(r["layer"], r["module"]) for r in ars]
        assert all(r["overlapped"] for r in ars[:-1]), [r["gemms_between"] for r in ars]
