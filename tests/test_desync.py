"""Desync Residual (`residual="desync"`, `ladder_jax.model.desync`) against the independent
float64 reference of tests/desync_reference.py (per-rank streams in numpy), on every pattern
and mesh tp; the invariants (one stream or every module syncing is the standard model, the
same model on any tp dividing desync_tp); cached decode against the full forward; gradients
across meshes; the compiled all-reduce count; one-line errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ladder_jax as lj
from ladder_jax.config import ConfigError, scheme_overrides
from ladder_jax.inference import generation
from ladder_jax.inference.cache import KVCache
from ladder_jax.model.sharding import ShardingError
from ladder_jax.train import step
from tests import desync_reference
from tests.helpers import TINY, logits, mesh

F, T_ = False, True
PATTERNS = ["every_layer", "every_2_layers", "final_only", ((T_, F), (F, F), (T_, T_), (F, T_))]


def _model(tp, seed=0, **changes):
    config = dataclasses.replace(TINY, residual="desync", **changes)
    return lj.Transformer(config, mesh=mesh(tp), rngs=nnx.Rngs(seed))


def _tokens(B=2, T=12, seed=1):
    return np.asarray(jax.random.randint(jax.random.key(seed), (B, T), 0, TINY.vocab_size))


def _weights(model):
    return nnx.to_pure_dict(nnx.state(model))


@pytest.mark.parametrize("pattern", PATTERNS, ids=["every", "every2", "final", "explicit"])
@pytest.mark.parametrize("desync_tp, tp", [(4, 4), (4, 2), (4, 1), (2, 2), (8, 8)])
def test_logits_equal_the_reference(pattern, desync_tp, tp):
    """Every pattern at desync_tp 2 / 4 / 8 (8 > 4 kv heads: streams share a kv head), on
    every mesh tp that divides it, against the numpy streams."""
    model = _model(tp, seed=3, reduce_pattern=pattern, desync_tp=desync_tp)
    assert model.config.desync_tp == desync_tp
    tokens = _tokens()
    want = desync_reference.forward_config(_weights(model), model.config, tokens)
    got = np.asarray(logits(model, tokens))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_the_streams_matter():
    """The control: desync_tp 4 is not the standard model, and two patterns differ."""
    tokens = _tokens()
    std = np.asarray(logits(lj.Transformer(TINY, mesh=mesh(1), rngs=nnx.Rngs(3)), tokens))
    every = np.asarray(logits(_model(1, seed=3, desync_tp=4), tokens))
    final = np.asarray(logits(_model(1, seed=3, desync_tp=4, reduce_pattern="final_only"), tokens))
    assert np.abs(every - std).max() > 1e-2 and np.abs(final - every).max() > 1e-2


def test_one_stream_or_every_module_syncing_is_standard():
    tokens = _tokens()
    std = np.asarray(logits(lj.Transformer(TINY, mesh=mesh(2), rngs=nnx.Rngs(3)), tokens))
    one = np.asarray(logits(_model(1, seed=3, desync_tp=1), tokens))
    np.testing.assert_allclose(one, std, atol=2e-5, rtol=2e-5)
    every = ((T_, T_),) * TINY.n_layers
    all_sync = np.asarray(logits(_model(2, seed=3, desync_tp=4, reduce_pattern=every), tokens))
    np.testing.assert_allclose(all_sync, std, atol=2e-5, rtol=2e-5)


def test_desync_tp_defaults_to_the_mesh_and_is_recorded():
    model = _model(2)
    assert model.config.desync_tp == 2
    assert lj.with_config(model, residual="standard").config.desync_tp is None
    again = lj.with_config(lj.with_config(model, residual="standard"), residual="desync")
    assert again.config.desync_tp == 2 and "desync_tp=2" in repr(model)


def _loss_and_grads(model, tokens):
    graphdef, params = nnx.split(model)
    fn = jax.jit(lambda p, t: step.loss_and_grads(graphdef, p, t[:, :-1], t[:, 1:]))
    loss, grads = fn(params, jnp.asarray(tokens))
    return float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


def test_gradients_equal_across_meshes():
    """desync_tp 4 on tp 4 and on tp 1 (one device, four streams): the same loss and
    gradients; check_vma=True holds (shard_map would refuse the program otherwise)."""
    tokens = _tokens(B=2, T=17)
    loss1, g1 = _loss_and_grads(_model(1, reduce_pattern="every_2_layers", desync_tp=4), tokens)
    loss4, g4 = _loss_and_grads(_model(4, reduce_pattern="every_2_layers", desync_tp=4), tokens)
    assert abs(loss1 - loss4) < 1e-5
    flat1, flat4 = jax.tree.leaves(g1), jax.tree.leaves(g4)
    assert len(flat1) == len(flat4)
    for a, b in zip(flat1, flat4):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4)
    assert any(np.abs(a).max() > 0 for a in flat1)


@pytest.mark.parametrize("tp", [1, 2])
def test_cached_decode_equals_the_full_forward(tp):
    """A ragged prefill (rows of different lengths) then decode steps against the cache give
    the full forward's logits at every new position."""
    model = _model(tp, reduce_pattern="every_2_layers", desync_tp=4)
    B, P, steps = 2, 9, 3
    tokens = _tokens(B=B, T=P + steps, seed=5)
    lengths = np.array([P, P - 4])
    want = np.asarray(logits(model, tokens))

    @nnx.jit
    def prefill(model, t, cache):
        return model.forward_cached(t, None, cache)

    @nnx.jit
    def decode(model, t, pos, cache):
        return model.forward_cached(t, pos, cache)

    cache = KVCache.init(model.config, model.mesh, B, 32).layers()
    out, cache = prefill(model, tokens[:, :P], cache)
    for b in range(B):
        np.testing.assert_allclose(out[b, : lengths[b]], want[b, : lengths[b]], atol=2e-5)
    for t in range(steps):
        pos = lengths + t
        step_tokens = tokens[np.arange(B), pos][:, None]
        out, cache = decode(model, step_tokens, pos[:, None].astype(np.int32), cache)
        for b in range(B):
            row = np.asarray(logits(model, tokens[b : b + 1, : pos[b] + 1]))[0, -1]
            np.testing.assert_allclose(np.asarray(out)[b, 0], row, atol=2e-5, rtol=2e-5)


def test_generate_is_the_references_greedy():
    """`generate` (fused-free decoding clone, ragged prompts) against the reference's greedy
    continuation by full forwards."""
    model = _model(2, seed=3, reduce_pattern="final_only", desync_tp=4)
    prompts = [[5, 17, 99, 3, 250, 7, 8], [11, 12, 13]]
    got = generation.generate(model, prompts, max_new_tokens=5)
    for prompt, tokens in zip(prompts, got):
        want = desync_reference.greedy(_weights(model), model.config, [prompt], 5, 4, "final_only")
        assert tokens == want[0].tolist()


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(reduce_pattern="every_3_layers"), "unknown reduce_pattern"),
        (dict(reduce_pattern=((F, T_),) * 3), r"give 4 \[attention, mlp\] pairs"),
        (dict(reduce_pattern=((F, T_),) * 3 + ((T_, F),)), "last layer's MLP must sync"),
        (dict(desync_tp=3), "desync_tp=3 cannot split"),
        (dict(desync_tp=0), "desync_tp=0 must be a positive integer"),
        (dict(residual="ladder", reduce_pattern="every_layer"), "only applies to"),
        (dict(residual="standard", desync_tp=2), "only applies to"),
    ],
)
def test_bad_patterns_are_config_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(TINY, **{"residual": "desync", **changes})


def test_a_mesh_that_cannot_carry_the_streams_is_refused():
    with pytest.raises(ShardingError, match="desync_tp=2 streams cannot be split over tp=4"):
        _model(4, desync_tp=2)


def test_scheme_overrides_carry_the_desync_keys():
    assert scheme_overrides(None, None, "final_only", 4) == {
        "residual": "desync",
        "ladder_layers": None,
        "reduce_pattern": "final_only",
        "desync_tp": 4,
    }
    assert scheme_overrides("desync", None) == {"residual": "desync", "ladder_layers": None}
    with pytest.raises(ConfigError, match="--desync-tp applies to --residual desync"):
        scheme_overrides("ladder", None, None, 2)


@pytest.mark.parametrize("pattern", ["every_layer", "every_2_layers", "final_only"])
def test_the_decode_program_all_reduces_once_per_synced_module(pattern):
    """The deviceless H100 decode step of tiny at tp 2 (desync_tp from the mesh): one
    all-reduce per synced module, attributed to it, and none for the others."""
    from ladder_jax.analysis import overlap

    config = lj.ModelConfig.from_preset("tiny", residual="desync", reduce_pattern=pattern)
    rep = overlap.report(config, phase="decode", tp=2, batch=1, seq=128)
    got = [(r["layer"], r["module"]) for r in rep["all_reduces"] if r["kind"] == "module"]
    syncs = config.desync_syncs()
    want = [(i, m) for i, pair in enumerate(syncs) for m, s in zip(("attn", "mlp"), pair) if s]
    assert got == want and len(want) == {"every_layer": 4, "every_2_layers": 2}.get(pattern, 1)


def test_hf_export_round_trips_the_desync_keys(tmp_path):
    """save_hf records reduce_pattern and desync_tp beside the ladder keys; load_hf reads
    them back (on another mesh: the same streams), keywords override them, another scheme
    drops them."""
    explicit = ((T_, F), (F, F), (T_, T_), (F, T_))
    model = _model(2, seed=3, reduce_pattern=explicit, desync_tp=4)
    lj.save_hf(model, tmp_path / "hf")
    again, _ = lj.load_hf(tmp_path / "hf", mesh=mesh(1))
    assert again.config == model.config and again.config.desync_tp == 4
    tokens = _tokens()
    np.testing.assert_allclose(logits(again, tokens), logits(model, tokens), atol=2e-5)
    other, _ = lj.load_hf(tmp_path / "hf", mesh=mesh(1), reduce_pattern="final_only", desync_tp=2)
    assert other.config.desync_syncs()[-2:] == ((F, F), (F, T_)) and other.config.desync_tp == 2
    plain, _ = lj.load_hf(tmp_path / "hf", mesh=mesh(1), residual="standard")
    assert plain.config.reduce_pattern is None and plain.config.desync_tp is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--residual", "desync", "--desync-tp", "3"], "desync_tp=3 cannot split"),
        (["--reduce-pattern", "ny,zz"], "--reduce-pattern 'ny,zz'"),
        (["--desync-tp", "4", "--tp", "8"], "desync_tp=4 streams cannot be split over tp=8"),
        (["--residual", "ladder", "--desync-tp", "2"], "--desync-tp applies to --residual"),
    ],
)
def test_decode_flags_say_what_is_wrong_in_one_line(capsys, flags, message):
    from ladder_jax.cli import decode as decode_cli
    from tests.helpers import exit_code, one_line

    argv = ["--preset", "tiny", "--prompt", "a", "--max-new-tokens", "2", *flags]
    assert message in one_line(capsys, exit_code(decode_cli.main, argv))


def test_decode_command_runs_a_desync_model(capsys):
    from ladder_jax.cli import decode as decode_cli

    argv = ["--preset", "tiny", "--prompt", "Once", "--max-new-tokens", "4", "--tp", "2"]
    assert decode_cli.main([*argv, "--reduce-pattern", "every_2_layers", "--desync-tp", "4"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and out.strip()


def test_convert_makes_and_keeps_a_desync_model(tmp_path, capsys):
    """convert --residual desync --reduce-pattern --desync-tp turns any Llama into a desync
    model (the same function as load_hf with those keywords); --to-hf of it keeps the keys."""
    from ladder_jax.cli import convert
    from ladder_jax.loading import load_model

    lj.save_hf(_model(1, seed=5), tmp_path / "hf")
    flags = ["--residual", "desync", "--reduce-pattern", "final_only", "--desync-tp", "2"]
    out = tmp_path / "run"
    assert convert.main(["--hf", str(tmp_path / "hf"), "--out", str(out), "--tp", "1", *flags]) == 0
    run, _ = load_model(str(out), mesh=mesh(1))
    want, _ = lj.load_hf(
        tmp_path / "hf", mesh=mesh(1), residual="desync", reduce_pattern="final_only", desync_tp=2
    )
    assert run.config.residual == "desync" and run.config.desync_tp == 2
    assert run.config.desync_syncs() == want.config.desync_syncs()
    tokens = _tokens()
    np.testing.assert_array_equal(logits(run, tokens), logits(want, tokens))
    standard, _ = lj.load_hf(tmp_path / "hf", mesh=mesh(1))
    assert np.abs(logits(run, tokens) - logits(standard, tokens)).max() > 1e-3
    assert convert.main(["--checkpoint", str(out), "--out", str(tmp_path / "back"), "--to-hf"]) == 0
    back, _ = lj.load_hf(tmp_path / "back", mesh=mesh(1))
    assert back.config.desync_syncs() == run.config.desync_syncs()
    assert back.config.desync_tp == 2
