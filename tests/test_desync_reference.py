"""The desync reference itself against what exists without it: the standard reference and model
(one stream, or every module syncing), a second construction by masking weights instead of
slicing them, and the preset patterns against the authors' published lists."""

import jax
import numpy as np
import pytest
from flax import nnx

from tests import desync_reference, reference
from tests.helpers import TINY
from tests.helpers import logits as _logits
from tests.helpers import tiny_model as _model

F, T_ = False, True


def _tokens(B=2, T=12, seed=1):
    return np.asarray(jax.random.randint(jax.random.key(seed), (B, T), 0, TINY.vocab_size))


@pytest.fixture(scope="module")
def standard():
    """(weights, config, tokens, the standard model's logits)."""
    model = _model(1, seed=3)
    tokens = _tokens()
    weights = nnx.to_pure_dict(nnx.state(model))
    return weights, model.config, tokens, np.asarray(_logits(model, tokens))


def test_presets_resolve_as_the_authors_lists():
    r = desync_reference.resolve_pattern
    assert r("every_layer", 3) == ((F, T_), (F, T_), (F, T_))
    assert r("final_only", 3) == ((F, F), (F, F), (F, T_))
    assert r("every_2_layers", 4) == ((F, F), (F, T_), (F, F), (F, T_))
    assert r("every_2_layers", 5) == ((F, F), (F, T_), (F, F), (F, T_), (F, T_))
    # gpt_desync_TP.py's "llama-3-8b-4x" list and its "-infinite" one (last MLP forced on).
    assert r("every_2_layers", 32) == ((F, F), (F, T_)) * 16
    assert r("final_only", 32) == ((F, F),) * 31 + ((F, T_),)
    assert r([[T_, F], [F, T_]], 2) == ((T_, F), (F, T_))
    for bad in ("every_3_layers", [[F, T_]], [[F, F], [F, F]], [[F, 1], [F, T_]]):
        with pytest.raises(ValueError):
            r(bad, 2)


@pytest.mark.parametrize("pattern", ["every_layer", "every_2_layers", "final_only"])
def test_one_stream_is_the_standard_model(standard, pattern):
    weights, cfg, tokens, model_logits = standard
    got = desync_reference.forward(weights, cfg, tokens, 1, pattern)
    assert got.dtype == np.float64
    want = np.asarray(reference.forward(weights, cfg, tokens))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got, model_logits, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("desync_tp", [2, 4, 8])  # 8 > 4 kv heads: streams share a kv head
def test_every_module_syncing_is_the_standard_model(standard, desync_tp):
    weights, cfg, tokens, model_logits = standard
    got = desync_reference.forward(weights, cfg, tokens, desync_tp, ((T_, T_),) * cfg.n_layers)
    np.testing.assert_allclose(got, model_logits, atol=2e-5, rtol=2e-5)


def test_final_only_on_two_streams_is_not_the_standard_model(standard):
    weights, cfg, tokens, model_logits = standard
    got = desync_reference.forward(weights, cfg, tokens, 2, "final_only")
    every = desync_reference.forward(weights, cfg, tokens, 2, "every_layer")
    assert np.abs(got - model_logits).max() > 1e-2
    assert np.abs(got - every).max() > 1e-2


def _masked_forward(weights, cfg, tokens, T, syncs):
    """Desync by zeroing the weights a stream does not own (full-size matrices, no slicing)."""
    N, F_ = cfg.n_heads, cfg.d_ff
    w = reference._plain(weights)
    inv_freq = reference._inv_freq(cfg, np.float64)
    heads, units = np.arange(N) * T // N, np.arange(F_) * T // F_  # the owning stream
    xs = [np.asarray(w["embed"], np.float64)[tokens]] * T
    for i, pair in enumerate(syncs):
        lw = jax.tree.map(lambda a: np.asarray(a, np.float64), w["layers"][i])
        for kind, sync in zip(("attn", "mlp"), pair, strict=True):
            parts = []
            for r, x in enumerate(xs):
                h = reference._norm(x, lw[f"{kind}_norm"]["scale"], cfg.norm_eps)
                if kind == "attn":
                    o = lw["attn"]["o"] * (heads == r)[:, None, None]
                    parts.append(reference._attention(lw["attn"] | {"o": o}, h, cfg, inv_freq))
                else:
                    down = lw["mlp"]["down"] * (units == r)[:, None]
                    parts.append(reference._mlp(lw["mlp"] | {"down": down}, h))
            if sync:
                xs = [sum(np.asarray(p) + x / T for p, x in zip(parts, xs, strict=True))] * T
            else:
                xs = [x + np.asarray(p) for x, p in zip(xs, parts, strict=True)]
    x = np.asarray(reference._norm(xs[0], np.asarray(w["final_norm"]["scale"]), cfg.norm_eps))
    return x @ np.asarray(w["head"], np.float64)


@pytest.mark.parametrize("desync_tp", [2, 8])
@pytest.mark.parametrize(
    "pattern", ["every_layer", "final_only", ((T_, F), (F, F), (T_, T_), (F, T_))]
)
def test_slicing_equals_masking(standard, desync_tp, pattern):
    weights, cfg, tokens, _ = standard
    syncs = desync_reference.resolve_pattern(pattern, cfg.n_layers)
    got = desync_reference.forward(weights, cfg, tokens, desync_tp, syncs)
    with jax.enable_x64(True):
        want = _masked_forward(weights, cfg, tokens, desync_tp, syncs)
    np.testing.assert_allclose(got, want, atol=1e-10, rtol=1e-10)


def test_greedy_follows_the_forward(standard):
    weights, cfg, tokens, _ = standard
    out = desync_reference.greedy(weights, cfg, tokens[:, :5], 3, 2, "final_only")
    full = desync_reference.forward(
        weights, cfg, np.concatenate([tokens[:, :5], out], 1), 2, "final_only"
    )
    np.testing.assert_array_equal(full[:, 4:-1].argmax(-1), out)
