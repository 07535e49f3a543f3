"""Tensor parallelism changes nothing but speed: TP=1 vs 2 vs 4 vs 8, with and without a data
axis."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ladder_jax as lj
from tests.helpers import SCHEMES as VALID
from tests.helpers import TINY
from tests.helpers import mesh as _mesh

SCHEMES = {**VALID, "tied-ladder": dict(residual="ladder", tie_embeddings=True)}
LAYOUTS = [(1, 1), (2, 1), (4, 1), (8, 1), (2, 4)]  # (tp, data)


def _loss_and_grads(config, tp, data, tokens, targets):
    model = lj.Transformer(config, mesh=_mesh(tp, data), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
        def loss(state):
            logits = nnx.merge(graphdef, state)(tokens)
            logp = jax.nn.log_softmax(logits, -1)
            return -jnp.take_along_axis(logp, targets[..., None], -1).mean(), logits

        (value, logits), g = jax.value_and_grad(loss, has_aux=True)(state)
        return value, logits, g

    value, logits, g = run(state)
    return (
        np.asarray(value),
        np.asarray(logits),
        jax.tree.map(np.asarray, nnx.to_pure_dict(g)),
        jax.tree.map(np.asarray, nnx.to_pure_dict(state)),
    )


@pytest.fixture(scope="module", params=list(SCHEMES), ids=list(SCHEMES))
def by_layout(request):
    config = dataclasses.replace(TINY, **SCHEMES[request.param])
    key = jax.random.key(7)
    tokens = jax.random.randint(key, (8, 16), 0, TINY.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    return {layout: _loss_and_grads(config, *layout, tokens, targets) for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda t: f"tp{t[0]}-data{t[1]}")
def test_same_weights_logits_and_grads(by_layout, layout):
    loss0, logits0, grads0, weights0 = by_layout[(1, 1)]
    loss, logits, grads, weights = by_layout[layout]
    # same seed -> the same global weights, whatever the mesh
    jax.tree.map(np.testing.assert_array_equal, weights, weights0)
    np.testing.assert_allclose(logits, logits0, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    flat0, flat = jax.tree.leaves_with_path(grads0), jax.tree.leaves(grads)
    assert len(flat0) == len(flat)
    for (path, g0), g in zip(flat0, flat):
        scale = np.abs(g0).max()
        np.testing.assert_allclose(
            g, g0, atol=1e-5 * max(scale, 1e-3), rtol=1e-4, err_msg=jax.tree_util.keystr(path)
        )


def test_gradients_are_not_trivially_zero(by_layout):
    _, _, grads, _ = by_layout[(8, 1)]
    norms = {jax.tree_util.keystr(p): np.abs(g).max() for p, g in jax.tree.leaves_with_path(grads)}
    zero = [p for p, n in norms.items() if n == 0 and "mlp_norm" not in p]
    assert not zero, zero


def test_weights_are_stored_sharded():
    model = lj.Transformer(TINY, mesh=_mesh(4, 1), rngs=nnx.Rngs(0))
    layer = model.layers[0]
    q, down = layer.attn.q.weight[...], layer.mlp.down.weight[...]
    assert q.sharding.shard_shape(q.shape) == (64, 2, 8)
    assert down.sharding.shard_shape(down.shape) == (32, 64)
    assert layer.attn.k.weight[...].sharding.shard_shape((64, 4, 8)) == (64, 1, 8)
    assert model.head.weight[...].sharding.shard_shape((64, 320)) == (64, 80)
    # n_kv_heads=4 < tp=8: kv weights are replicated, query heads still split
    model8 = lj.Transformer(TINY, mesh=_mesh(8, 1), rngs=nnx.Rngs(0))
    assert model8.layers[0].attn.k.weight[...].sharding.shard_shape((64, 4, 8)) == (64, 4, 8)
    assert model8.layers[0].attn.kv_replicated


@pytest.mark.parametrize(
    "changes, tp, match",
    [
        (dict(n_heads=6, n_kv_heads=6, d_model=48), 4, r"n_heads=6 is not divisible by tp=4"),
        (dict(n_heads=12, n_kv_heads=6, d_model=96), 4, r"n_kv_heads=6 is not divisible by tp=4"),
        (dict(n_heads=8, n_kv_heads=8, d_ff=100), 8, r"d_ff=100 is not divisible by tp=8"),
        (dict(vocab_size=300), 8, r"vocab_size=300 .* pad vocab_size to 304"),
    ],
)
def test_unshardable_configs_fail_at_construction(changes, tp, match):
    config = dataclasses.replace(TINY, **changes)
    with pytest.raises(lj.ShardingError, match=match):
        lj.Transformer(config, mesh=_mesh(tp, 1), rngs=nnx.Rngs(0))


def test_mesh_and_batch_errors():
    with pytest.raises(lj.ShardingError, match="tp=3 does not divide the 8 available devices"):
        lj.make_mesh(tp=3)
    with pytest.raises(lj.ShardingError, match="data=4 x tp=4 = 16 devices, but 8"):
        lj.make_mesh(tp=4, data=4)
    model = lj.Transformer(TINY, mesh=_mesh(2, 4), rngs=nnx.Rngs(0))
    with pytest.raises(lj.ShardingError, match="batch size 6 is not divisible by the data axis"):
        model(jnp.zeros((6, 4), jnp.int32))
