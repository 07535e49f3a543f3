"""Fused attention and the parallel scheme's fused input projection, against references.

Tolerances: float32 on CPU, fused (XLA's `dot_product_attention`, the Pallas kernel run by
Pallas's interpreter) vs the reference einsum attention `attend`: 1e-5 absolute on outputs of
unit-variance inputs, 1e-5 relative to the largest gradient entry.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ladder_jax as lj
from ladder_jax.analysis import overlap, programs
from ladder_jax.analysis.kernels import read_kernels
from ladder_jax.inference.cache import KVCache
from ladder_jax.model import attention, quant, transformer
from ladder_jax.model.linear import flat_einsum
from tests import helpers
from tests.helpers import TINY, tiny_model

TOL = 1e-5


def _qkv(B=2, T=128, N=8, K=2, H=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (B, T, N, H)),
        jax.random.normal(keys[1], (B, T, K, H)),
        jax.random.normal(keys[2], (B, T, K, H)),
    )


def _reference(q, k, v):
    B, T = q.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    return attention.attend(q, k, v, pos, pos)


def _check_against_reference(fused, q, k, v):
    w = jax.random.normal(jax.random.key(9), q.shape)  # a loss that weighs every output
    np.testing.assert_allclose(
        np.asarray(fused(q, k, v)), np.asarray(_reference(q, k, v)), atol=TOL, rtol=0
    )
    got = jax.grad(lambda *a: (fused(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: (_reference(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=TOL * np.abs(r).max())


def test_xla_fused_attention_equals_reference_gqa_forward_and_backward():
    q, k, v = _qkv(T=40)
    _check_against_reference(jax.jit(lambda *a: attention.attend_causal(*a, "xla")), q, k, v)


def test_flat_matmuls_equal_the_einsums():
    """`linear.flat_einsum` (CPU meshes' linear layers) against `jnp.einsum` on every linear
    spec of the model, values and gradients of both operands; a spec that is not a linear
    layer's contraction is refused."""
    keys = jax.random.split(jax.random.key(4), 4)
    shapes = {"B": 2, "T": 5, "D": 12, "N": 3, "K": 2, "H": 4, "F": 7, "C": 9}
    for spec in (
        "BTD,DNH->BTNH",
        "BTD,DKH->BTKH",
        "BTNH,NHD->BTD",
        "BTD,DF->BTF",
        "BTF,FD->BTD",
        "BTD,DC->BTC",
    ):
        xs, ws = spec.split("->")[0].split(",")
        x = jax.random.normal(keys[0], [shapes[c] for c in xs])
        w = jax.random.normal(keys[1], [shapes[c] for c in ws])
        g = jax.random.normal(keys[2], jnp.einsum(spec, x, w).shape)
        for a, b in zip(
            jax.vjp(lambda x, w: flat_einsum(spec, x, w), x, w)[1](g),
            jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x, w)[1](g),
        ):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            np.asarray(flat_einsum(spec, x, w)),
            np.asarray(jnp.einsum(spec, x, w)),
            rtol=1e-5,
            atol=1e-5,
        )
    with pytest.raises(ValueError, match="not a linear layer"):
        flat_einsum("BTD,BSD->BTS", jnp.ones((1, 2, 3)), jnp.ones((1, 2, 3)))


def test_pallas_flash_attention_interpreted_equals_reference():
    """The kernel the deviceless H100 programs hold, run on CPU by Pallas's interpreter,
    through the model's own wrapper (GQA by repeated kv heads, custom backward)."""
    q, k, v = _qkv(B=1, T=128, N=4, K=2, H=16)

    def pallas(q, k, v):
        G = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
        return attention.pallas_flash(q, k, v, 1.0 / np.sqrt(q.shape[-1]), True)

    _check_against_reference(jax.jit(pallas), q, k, v)


def _naive(q, k, v, q_pos, k_pos):
    """Grouped-query attention written independently of the model's: kv heads repeated to
    the query heads, one einsum per product, -inf where a query may not see a key."""
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where((k_pos[:, None, :] <= q_pos[:, :, None])[:, None], s, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def _check_against_naive(got, q, k, v, q_pos, k_pos, tol=TOL):
    w = jax.random.normal(jax.random.key(7), q.shape)
    want = lambda *a: _naive(*a, q_pos, k_pos)  # noqa: E731
    np.testing.assert_allclose(
        np.asarray(jax.jit(got)(q, k, v)), np.asarray(want(q, k, v)), atol=tol, rtol=0
    )
    gg = jax.jit(jax.grad(lambda *a: (got(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
    gw = jax.grad(lambda *a: (want(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(gg, gw):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol * np.abs(b).max())


@pytest.mark.parametrize("T", [40, 128, 300])
def test_cpu_causal_kernel_equals_a_naive_reference_forward_and_backward(T):
    """CPU's kernel "matmul" (softmax normalized after the values' product) against autodiff
    of `_naive`, GQA (8 query / 2 kv heads): one query block (40), two (128), five with a
    short last one (300: `causal_blocks`)."""
    assert len(attention.causal_blocks(T)) == {40: 1, 128: 2, 300: 5}[T]
    q, k, v = _qkv(T=T)
    pos = jnp.broadcast_to(jnp.arange(T), (2, T))
    _check_against_naive(lambda *a: attention.attend_causal(*a, "matmul"), q, k, v, pos, pos)


def test_attention_over_given_positions_and_a_cache_equals_a_naive_reference():
    """`attend` (explicit positions) and `attend_cache` (the decode step's, keys and values
    in the cache's layout) against `_naive`: ragged rows (row 1 sees half the keys), one query
    per row over a cache with unwritten slots, values and gradients."""
    q, k, v = _qkv(T=32)
    q_pos = jnp.stack([jnp.arange(32), jnp.arange(32) // 2])
    k_pos = jnp.broadcast_to(jnp.arange(32), (2, 32))
    _check_against_naive(lambda *a: attention.attend(*a, q_pos, k_pos), q, k, v, q_pos, k_pos)
    q1, q1_pos = q[:, :1], jnp.array([[31], [9]])  # a decode step: row 1's cache is shorter
    _check_against_naive(
        lambda q, k, v: attention.attend_cache(
            q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), q1_pos, k_pos
        ),
        q1,
        k,
        v,
        q1_pos,
        k_pos,
    )


def test_kernel_choice_by_platform():
    mesh = helpers.mesh(1)
    assert attention.attention_kernel(mesh, "bfloat16", 128) == "matmul"  # CPU
    gpu = programs.gpu_mesh("h100", 2)  # deviceless: cuDNN cannot be compiled here
    assert attention.attention_kernel(gpu, "bfloat16", 128) == "pallas"
    with pytest.raises(ValueError, match="unknown attention kernel"):
        attention.attend_causal(*_qkv(T=8), "flash")


@pytest.mark.parametrize("kernel", ["matmul", "xla"])
@pytest.mark.parametrize("tp", [1, 4])
def test_model_with_fused_attention_equals_the_reference_attention(tp, kernel):
    """Default positions (the kernel: CPU's default "matmul", and jax's `dot_product_attention`
    "xla", an independent implementation) vs the same positions given explicitly (the
    reference `attend`), logits and gradients, GQA (8 query / 4 kv heads), at tp 1 and 4."""
    model = tiny_model(tp, residual="ladder", ladder_layers=2)
    assert {layer.attn.kernel for layer in model.layers} == {"matmul"}  # CPU's choice
    for layer in model.layers:
        layer.attn.kernel = kernel
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, TINY.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), tokens.shape)
    graphdef, state = nnx.split(model)
    w = jax.random.normal(jax.random.key(2), (2, 24, TINY.vocab_size))

    @jax.jit
    def both(state):
        def loss(state, pos):
            return (nnx.merge(graphdef, state)(tokens, pos) * w).sum()

        return jax.value_and_grad(loss)(state, None), jax.value_and_grad(loss)(state, positions)

    (fused, g_fused), (ref, g_ref) = both(state)
    np.testing.assert_allclose(float(fused), float(ref), rtol=TOL)
    for a, b in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL * np.abs(b).max())


@pytest.mark.parametrize("tp", [1, 4, 8])  # 8: fewer kv heads (4) than ranks, replicated
@pytest.mark.parametrize(
    "scheme",
    [
        {"residual": "parallel"},
        {"residual": "standard"},
        {"residual": "ladder", "ladder_layers": 2},
    ],
    ids=["parallel", "standard", "hybrid"],
)
def test_fused_projections_equal_the_separate_matmuls(tp, scheme):
    """A decoding clone (`fuse_inputs`: parallel's five input matmuls as one, every other
    scheme's q/k/v and gate/up as one each) against the model it came from: the prefill of
    ragged prompts (positions None) and a decode step against the cache (explicit
    positions), logits and caches."""
    model = tiny_model(tp, **scheme)
    fused = transformer.fuse_inputs(model)
    for layer in fused.layers:
        assert layer.attn.q is None and layer.mlp.gate is None
        if scheme["residual"] == "parallel":
            assert layer.fused_in is not None
        else:
            assert layer.attn.qkv is not None and layer.mlp.gate_up is not None
    assert model.layers[0].attn.q is not None  # the model itself is untouched
    tokens = jax.random.randint(jax.random.key(3), (8, 16), 0, TINY.vocab_size)

    @jax.jit
    def run(m):
        cache = KVCache.init(m.config, m.mesh, 8, 32).layers()
        logits, cache = m.forward_cached(tokens, None, cache)
        pos = jnp.full((8, 1), 16, jnp.int32)
        step, cache = m.forward_cached(tokens[:, :1], pos, cache)
        return logits, step, cache

    want, got = run(model), run(fused)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


def test_int8_models_are_fused_with_their_scales():
    """int8 weights fuse like float ones, each scale beside its weight (the fused decode equals
    the separate projections: tests/test_quant.py)."""
    model = quant.quantize(tiny_model(1, residual="ladder"))
    fused = transformer.fuse_inputs(model)
    for layer in fused.layers:
        for joined in (layer.attn.qkv, layer.mlp.gate_up):
            assert joined.weight.value.dtype == jnp.int8 and joined.scale is not None


# ---------------------------------------------------------------------------------------------
# The compiled H100 programs (deviceless).

# tiny at a width where XLA:GPU's dot merger acts on parallel's five input matmuls
WIDE = {"d_model": 512, "n_heads": 8, "n_kv_heads": 8, "d_ff": 2048}


def _hlo(phase, **changes):
    config = lj.ModelConfig.from_preset("tiny", **{**WIDE, **changes})
    return programs.compile_program(config, phase=phase, tp=8, batch=8, seq=128, new_tokens=64)[0]


def _concatenates(hlo):
    """Shapes of the concatenates in the compiled program, fused ones included."""
    return re.findall(r"= (\S+\[[\d,]*\])\S* concatenate\(", hlo)


@pytest.mark.parametrize("phase", ["prefill", "train"])
def test_h100_ladder_programs_hold_the_fused_attention_and_keep_their_overlap(phase):
    hlo = _hlo(phase, residual="ladder")
    kernels = hlo.count('custom_call_target="__gpu$xla.gpu.triton"')
    layers = 4
    # one flash kernel per layer forward; the backward adds two per layer (preprocess, dq/dkv)
    assert kernels == (layers if phase == "prefill" else 3 * layers), kernels
    assert "mha_forward" in hlo
    # the performance model counts the flash kernels' causal matmul FLOPs: per layer and
    # device (1 of 8 heads, head_dim 64), 2 matmuls forward and 5 backward of 2*B*H*T*S*D over
    # the causal (T + 1) / 2T of the scores
    b, h, t, d = 8, 1, 128, WIDE["d_model"] // WIDE["n_heads"]
    per_matmul = 2.0 * b * h * t * t * d * (t + 1) / (2 * t)
    flash = sum(k.flops for k in read_kernels(hlo, devices=8) if k.name.startswith("pallas_call"))
    assert flash == pytest.approx(
        layers * per_matmul * (2 if phase == "prefill" else 7), rel=1e-9
    ), flash
    rep = overlap.summarize(overlap.read_all_reduces(hlo, WIDE["d_model"]))
    assert rep["forward"]["total"] == 2 * layers and rep["forward"]["all_but_last_overlapped"]
    if phase == "train":
        assert rep["backward"]["total"] == 2 * layers + 1  # the head's, then the modules'
        assert rep["backward"]["all_but_last_overlapped"]


@pytest.mark.parametrize("residual", ["parallel", "standard", "ladder"])
def test_h100_decode_concatenates_no_weights(residual):
    """The decode step reads fused weights (parallel: one per layer; the others: q/k/v and
    gate/up): no (D, C) concatenate of weights in the program, where the separate matmuls
    had XLA's dot merger build them every step (standard and ladder: a (512, 192) q/k/v and
    a (512, 512) gate/up per layer at batch 8)."""
    hlo = _hlo("decode", residual=residual)
    d = WIDE["d_model"]
    weights = [s for s in _concatenates(hlo) if re.search(rf"\[{d},\d+\]|\[\d+,{d}\]", s)]
    assert weights == [], weights
