"""The model against an independent reference, scheme by scheme, plus its invariants."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ladder_jax as lj
from ladder_jax.model import attention
from tests import helpers, reference
from tests.helpers import TINY
from tests.helpers import logits as _logits
from tests.helpers import tiny_model as _model


def _tokens(B=2, T=12, seed=1, vocab=TINY.vocab_size):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, vocab)


SCHEMES = [
    dict(residual="standard"),
    dict(residual="parallel"),
    dict(residual="ladder"),
    dict(residual="ladder", ladder_layers=2),  # hybrid: upper 2 of 4 layers
    dict(residual="ladder", ladder_layers=(1, 3)),  # ladder, standard, ladder, standard... mixed
]


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: "-".join(map(str, s.values())))
def test_matches_reference(scheme, tp):
    model = _model(tp, **scheme)
    tokens = _tokens()
    got = np.asarray(_logits(model, tokens))
    want = np.asarray(reference.forward(nnx.to_pure_dict(nnx.state(model)), model.config, tokens))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("tp", [1, 8])
def test_tied_embeddings_and_rope_scaling_match_reference(tp):
    # original_max_len small enough that all three RoPE scaling regimes occur at head_dim 8.
    scaling = lj.RopeScaling(
        factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=64
    )
    model = _model(
        tp, residual="ladder", tie_embeddings=True, rope_scaling=scaling, rope_theta=500.0
    )
    assert model.head is None
    tokens = _tokens(T=40)
    got = np.asarray(_logits(model, tokens))
    want = np.asarray(reference.forward(nnx.to_pure_dict(nnx.state(model)), model.config, tokens))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    no_scaling = lj.with_config(model, rope_scaling=None)
    assert np.abs(np.asarray(_logits(no_scaling, tokens)) - got).max() > 1e-4


def test_ladder_layers_zero_is_standard_bit_for_bit():
    std = _model(residual="standard")
    tokens = _tokens()
    a = np.asarray(_logits(std, tokens))
    b = np.asarray(_logits(lj.with_config(std, residual="ladder", ladder_layers=0), tokens))
    np.testing.assert_array_equal(a, b)


def test_ladder_differs_from_standard():
    std = _model(residual="standard")
    tokens = _tokens()
    a = np.asarray(_logits(std, tokens))
    lad = np.asarray(_logits(lj.with_config(std, residual="ladder"), tokens))
    hyb = np.asarray(_logits(lj.with_config(std, residual="ladder", ladder_layers=1), tokens))
    assert np.abs(a - lad).max() > 1e-3
    assert np.abs(a - hyb).max() > 1e-4
    assert np.abs(lad - hyb).max() > 1e-4


def test_upper_bound_is_standard_at_tp1_and_diverges_at_tp8():
    tokens = _tokens()
    std1 = np.asarray(_logits(_model(1, residual="standard"), tokens))
    ub1 = np.asarray(_logits(_model(1, residual="upper_bound"), tokens))
    ub8 = np.asarray(_logits(_model(8, residual="upper_bound"), tokens))
    np.testing.assert_array_equal(std1, ub1)
    assert np.abs(ub8 - std1).max() > 1e-3  # no communication: not a valid model


@pytest.mark.parametrize("scheme", SCHEMES[:3], ids=lambda s: s["residual"])
def test_causality(scheme):
    """d logits[:, :t] / d embedding(token at t) == 0 and d logits[:, t:] / d it != 0."""
    model = _model(4, **scheme)
    T, t = 10, 6
    tokens = np.asarray(_tokens(B=1, T=T)) % 200
    tokens[0, t] = 300  # the only occurrence of id 300; untied head, so its row is its input
    graphdef, state = nnx.split(model)

    def partial_logits(state, upto):
        logits = nnx.merge(graphdef, state)(tokens)
        return logits[:, :t].sum() if upto else logits[:, t:].sum()

    for upto, zero in ((True, True), (False, False)):
        g = jax.jit(jax.grad(partial_logits), static_argnums=1)(state, upto)
        row = np.asarray(g["embed"][...][300])
        assert (np.abs(row).max() == 0) == zero, (upto, np.abs(row).max())


def test_logits_shape_dtype_and_bad_tokens():
    model = _model(2)
    out = _logits(model, _tokens(B=2, T=5))
    assert out.shape == (2, 5, TINY.vocab_size) and out.dtype == jnp.float32
    with pytest.raises(ValueError, match="integers of shape"):
        model(jnp.zeros((5,), jnp.int32))


def test_param_count_formula():
    cfg = lj.ModelConfig.from_preset("llama-3-8b")
    assert round(cfg.num_params() / 1e9, 2) == 8.03
    big = lj.ModelConfig.from_preset("llama-3-70b")
    assert big.num_params() == pytest.approx(70.55e9, rel=1e-3)
    # the formula equals the real tree on a small model, tied and untied
    for tied in (False, True):
        model = _model(1, tie_embeddings=tied)
        n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert n == model.config.num_params()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(residual="ladderr"), "did you mean 'ladder'"),
        (dict(residual="ladder", ladder_layers=9), "between 0 and n_layers=4"),
        (dict(residual="ladder", ladder_layers=[0, 0]), "distinct layer indices"),
        (dict(residual="standard", ladder_layers=2), "only applies to residual='ladder'"),
        (dict(n_heads=8, n_kv_heads=3), "not divisible by n_kv_heads=3"),
        (dict(d_model=65), "set head_dim"),
        (dict(dtype="float33"), "not a dtype"),
    ],
)
def test_bad_configs(kwargs, match):
    with pytest.raises(lj.ConfigError, match=match):
        lj.ModelConfig.from_preset("tiny", **kwargs)


def test_unknown_preset_and_field():
    with pytest.raises(
        lj.ConfigError, match="unknown preset 'llama-3-8B'.*did you mean 'llama-3-8b'"
    ):
        lj.ModelConfig.from_preset("llama-3-8B")
    with pytest.raises(lj.ConfigError, match="did you mean 'n_layers'"):
        lj.ModelConfig.from_preset("tiny", n_layer=3)


def _grads_vs_reference(config, tp, data, B=4, T=12):
    mesh = helpers.mesh(tp, data)
    model = lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0))
    tokens = _tokens(B=B, T=T)
    w = jax.random.normal(jax.random.key(3), (B, T, config.vocab_size))
    graphdef, state = nnx.split(model)
    got = jax.jit(jax.grad(lambda s: (nnx.merge(graphdef, s)(tokens) * w).sum()))(state)
    f32 = dataclasses.replace(config, dtype="float32", param_dtype="float32")
    weights = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), nnx.to_pure_dict(state))
    want = jax.grad(lambda p: (reference.forward(p, f32, tokens) * w).sum())(weights)
    return nnx.to_pure_dict(got), want


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: "-".join(map(str, s.values())))
def test_gradients_match_reference(scheme):
    """The ladder's hand-written backward (and autodiff elsewhere) against autodiff of the
    plain reference, with a data axis, so data-parallel gradient sums are covered too."""
    got, want = _grads_vs_reference(dataclasses.replace(TINY, **scheme), tp=4, data=2)
    for (path, g), r in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(
            np.asarray(g),
            np.asarray(r),
            rtol=2e-4,
            atol=2e-5 * np.abs(r).max(),
            err_msg=jax.tree_util.keystr(path),
        )


def test_bf16_ladder_gradients_track_the_float32_reference():
    config = dataclasses.replace(TINY, residual="ladder", ladder_layers=3, dtype="bfloat16")
    got, want = _grads_vs_reference(config, tp=4, data=1)
    for (path, g), r in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
        g, r = np.asarray(g, np.float32), np.asarray(r)
        rel = np.linalg.norm(g - r) / np.linalg.norm(r)
        assert rel < 0.05, (jax.tree_util.keystr(path), rel)


@pytest.mark.parametrize("head_dim", [8, 64, 72, 96, 128, 256])
@pytest.mark.parametrize("theta", [1e4, 5e5, 1e6])
def test_rope_frequencies_are_within_a_few_ulp_of_the_exact_values(head_dim, theta):
    """Against float64: theta ** -(2i / H), and llama-3 scaling by hand (wavelengths above
    8192 / 1 scaled by 1/8, below 8192 / 4 kept, between interpolated). The float32 power
    and reciprocal: 2 ulp. Where 2i / H is no power-of-two fraction, its float32 rounding
    (relative 2^-23 at most) moves theta ** -e by ln(theta) times that: 2 ln(theta) ulp more;
    the interpolation's float32 steps 2 more."""
    base = dataclasses.replace(TINY, head_dim=head_dim, rope_theta=theta)
    exact = theta ** -(np.arange(0, head_dim, 2) / head_dim)
    scaling = lj.RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192
    )
    wavelen = 2 * np.pi / exact
    smooth = (8192 / wavelen - 1.0) / 3.0
    mid = (1 - smooth) * exact / 8 + smooth * exact
    scaled = np.where(wavelen > 8192, exact / 8, np.where(wavelen < 2048, exact, mid))
    bound = 2.0 + (0.0 if head_dim & (head_dim - 1) == 0 else 2 * np.log(theta))
    scaled_config = dataclasses.replace(base, rope_scaling=scaling)
    for config, want, ulps in [(base, exact, bound), (scaled_config, scaled, bound + 2)]:
        got = np.asarray(attention.rope_frequencies(config)).astype(np.float64)
        ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
        assert np.max(np.abs(got - want) / ulp) <= ulps, (config.rope_scaling, got - want)
