"""The Triton small-M matmul (`ladder_jax.model.matvec`), run through Pallas's interpreter on
CPU, against a float64 product of the same values; the tiling rules and the XLA fallback; a
`Linear` set to it inside shard_map against its XLA einsum.

Tolerance: the output's bfloat16 rounding, 2**-8 of the largest output, plus float32 sums.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ladder_jax.model import matvec, quant, sharding
from ladder_jax.model.linear import Linear


def _operands(m, k, n, w_dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.float32)
    if w_dtype == "int8":
        w = jnp.clip(jnp.round(w * 40), -127, 127).astype(jnp.int8)
        scale = jax.random.uniform(keys[2], (n,), jnp.float32, 0.005, 0.02)
    else:
        w, scale = w.astype(jnp.bfloat16), None
    return x, w, scale


def _close(got, x, w, scale):
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if scale is not None:
        want = want * np.asarray(scale, np.float64)
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0**-8 * np.abs(want).max() + 1e-3)


@pytest.mark.parametrize(
    "m, k, n, w_dtype",
    [
        (1, 256, 64, "bfloat16"),  # one row: the multiply-and-sum form, no padding
        (3, 512, 48, "bfloat16"),  # rows padded to 4, a width of three blocks of 16
        (16, 4096, 64, "bfloat16"),  # Triton's dot, the contraction split (partials summed)
        (2, 4096, 32, "int8"),  # few columns: many splits
        (16, 1024, 256, "int8"),  # Triton's dot, int8 scaled inside
        (16, 256, 2048, "bfloat16"),  # many columns: one split
    ],
)
def test_small_m_matmul_equals_the_product(m, k, n, w_dtype):
    x, w, scale = _operands(m, k, n, w_dtype)
    p = matvec.plan(m, k, n, x.dtype, w.dtype)
    assert p is not None and p.rows >= m and (p.rows >= 16) == p.dot
    if k == 4096:
        assert p.splits > 1
    got = jax.jit(lambda *a: matvec.small_m_matmul(*a, interpret=True))(x, w, scale)
    assert got.dtype == jnp.bfloat16
    _close(got, x, w, scale)


def test_the_tiling_splits_only_where_columns_are_few():
    wide = matvec.plan(16, 4096, 28672, jnp.bfloat16, jnp.bfloat16)
    narrow = matvec.plan(16, 4096, 768, jnp.bfloat16, jnp.bfloat16)
    assert wide.splits == 1 and 28672 // wide.block_n >= matvec.TARGET_PROGRAMS
    assert narrow.splits > 1 and narrow.block_n == 16
    for p, n in ((wide, 28672), (narrow, 768)):  # partial sums stay small beside W
        assert p.splits == 1 or p.splits * p.rows * n * 4 <= 4096 * n * 2 / 64
        assert 4096 % (p.splits * p.block_k) == 0


@pytest.mark.parametrize(
    "m, k, n, x_dtype, w_dtype",
    [
        (17, 256, 64, jnp.bfloat16, jnp.bfloat16),  # more rows than the kernel takes
        (1, 256, 40, jnp.bfloat16, jnp.bfloat16),  # columns not a multiple of 16
        (1, 200, 64, jnp.bfloat16, jnp.int8),  # a contraction not a multiple of 16
        (1, 256, 64, jnp.float32, jnp.float32),  # float32 activations
        (1, 256, 64, jnp.bfloat16, jnp.float32),  # a weight in neither x's dtype nor int8
    ],
)
def test_shapes_triton_cannot_block_fall_back(m, k, n, x_dtype, w_dtype):
    assert matvec.plan(m, k, n, x_dtype, w_dtype) is None
    x = jnp.zeros((m, k), x_dtype)
    assert matvec.small_m_matmul(x, jnp.zeros((k, n), w_dtype)) is None


def _linear(shape, equation, quantized):
    mesh = sharding.make_mesh(tp=1, data=1, devices=jax.devices()[:1])
    w = jax.random.normal(jax.random.key(3), shape, jnp.float32).astype(jnp.bfloat16)
    linear = Linear(nnx.Param(w, spec=P()), equation, matmul="pallas")
    if quantized:
        quant.quantize_linear(linear, mesh)
    return linear, mesh


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize(
    "equation, w_shape, x_shape",
    [
        ("BTD,DNH->BTNH", (256, 4, 32), (2, 1, 256)),  # q: two output axes
        ("BTNH,NHD->BTD", (4, 32, 256), (16, 1, 4, 32)),  # o: two contracted axes
        ("BTD,DC->BTC", (256, 40), (2, 1, 256)),  # 40 columns: the einsum
    ],
)
def test_a_linear_through_the_kernel_equals_its_einsum(quantized, equation, w_shape, x_shape):
    """Inside shard_map (the model's setting), `Linear.small_m` (interpreted) equals the
    XLA einsum and rescale of the same `Linear`, int8 scales included; where the shape does
    not fit it says None and `Linear.__call__` runs the einsum. (Pallas's interpreter cannot
    run under shard_map's type check; the compiled programs of tests/test_roofline.py hold
    the kernel with the check on.)"""
    linear, mesh = _linear(w_shape, equation, quantized)
    x = jax.random.normal(jax.random.key(4), x_shape, jnp.float32).astype(jnp.bfloat16)
    graphdef, state = nnx.split(linear)

    def run(state, x, kernel):
        lin = nnx.merge(graphdef, state)
        if kernel:
            y = lin.small_m(x, jnp.bfloat16, interpret=True)
            return jnp.full(x.shape[:-1] + (1,), jnp.nan, x.dtype) if y is None else y[0]
        lin.matmul = "xla"
        return lin(x, jnp.bfloat16)

    specs = jax.tree.map(lambda _: P(), state)
    outs = [
        jax.jit(
            jax.shard_map(
                lambda s, x, kernel=kernel: run(s, x, kernel),
                mesh=mesh,
                in_specs=(specs, P()),
                out_specs=P(),
                check_vma=False,
            )
        )(state, x)
        for kernel in (True, False)
    ]
    fits = w_shape[-1] % 16 == 0
    if not fits:
        assert np.isnan(np.asarray(outs[0], np.float32)).all()
        return
    got, want = (np.asarray(o, np.float64) for o in outs)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0**-7 * np.abs(want).max())


def test_only_gpu_meshes_run_the_kernel():
    """`decode_matmul="pallas"` reaches the linear layers of GPU meshes (deviceless here), and
    of their decoding fusions and `with_config` clones; a CPU mesh keeps XLA's matmul, so its
    programs (and cached decode == full forward) are unchanged. A bad value is one line."""
    import ladder_jax as lj
    from ladder_jax.analysis import programs
    from ladder_jax.model.transformer import abstract, fuse_inputs, with_config

    cfg = lj.ModelConfig.from_preset("tiny", decode_matmul="pallas")
    cpu_mesh = sharding.make_mesh(tp=1, data=1, devices=jax.devices()[:1])
    cpu = nnx.merge(*abstract(cfg, cpu_mesh))
    assert {lin.matmul for lin in quant.linears(fuse_inputs(cpu))} == {"xla"}
    gpu = nnx.merge(*abstract(cfg, programs.gpu_mesh("h100", 2)))
    assert {lin.matmul for lin in quant.linears(fuse_inputs(gpu))} == {"pallas"}
    back = with_config(gpu, decode_matmul="xla")
    assert {lin.matmul for lin in quant.linears(back)} == {"xla"}
    assert {lin.matmul for lin in quant.linears(gpu)} == {"pallas"}  # the original is kept
    with pytest.raises(lj.ConfigError, match=r"decode_matmul='triton': choose one of xla, pallas"):
        lj.ModelConfig.from_preset("tiny", decode_matmul="triton")


def test_predict_bad_decode_matmul_is_one_line_exit_2(capsys):
    from ladder_jax.cli import predict as predict_cli

    assert predict_cli.main(["--preset", "tiny", "--decode-matmul", "triton"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1, err
    assert err[0] == "error: decode_matmul='triton': choose one of xla, pallas", err


def _bf16(a):
    """float64 values rounded to bfloat16, as float64."""
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)


@pytest.mark.parametrize(
    "m, k, n, w_dtype, fold",
    [
        (1, 256, 64, "bfloat16", "norm"),  # the multiply-and-sum form
        (16, 4096, 64, "int8", "norm"),  # Triton's dot, the contraction split
        (2, 512, 256, "bfloat16", "norm+joins"),  # a reduced output joins the stream first
        (16, 1024, 64, "int8", "norm+joins"),
        (3, 512, 48, "int8", "gate_up"),  # rows padded to 4
        (16, 1024, 256, "bfloat16", "gate_up"),
        (2, 256, 2048, "int8", "residual"),  # one split: the add in the kernel
        (16, 4096, 64, "bfloat16", "residual"),  # split: the add in the partials' sum
        (1, 4096, 32, "int8", "gate_up+residual"),  # a down projection
        (16, 512, 64, "bfloat16", "norm+joins2"),  # two outputs join; the stream not written
        (16, 1024, 128, "int8", "norm+joins2+swiglu"),  # a standard MLP's gate/up at tp > 1
        (3, 256, 96, "bfloat16", "swiglu"),  # the no-dot form, rows padded
    ],
)
def test_folded_prologue_and_epilogue_equal_the_unfused_arithmetic(m, k, n, w_dtype, fold):
    """RMSNorm of the float32 stream (prologue; after reduced outputs join it: `joins`),
    silu(gate) * up (prologue, or of the outputs in the epilogue: `swiglu`) and the residual
    add (epilogue) inside the kernel, against float64 of the unfused steps: the matmul's input
    rounded to bfloat16 as the unfused path feeds it, the output rounded before the add."""
    x, w, scale = _operands(m, k, n, w_dtype)
    keys = jax.random.split(jax.random.key(7), 4)
    kw, offset, joins = {}, 0, ()
    if "norm" in fold:
        x = 3.0 * jax.random.normal(keys[0], (m, k), jnp.float32)  # the stream
        ns = jax.random.uniform(keys[1], (k,), jnp.float32, 0.5, 1.5).astype(jnp.bfloat16)
        kw["norm"], eps = (ns, 1e-5), 1e-5
        x64 = np.asarray(x, np.float64)
        if "joins" in fold:
            joins = tuple(
                jax.random.normal(keys[2 + i], (m, k), jnp.float32).astype(jnp.bfloat16)
                for i in range(2 if "joins2" in fold else 1)
            )
            kw["joins"] = joins if "joins2" in fold else joins[0]
            kw["write_stream"] = "swiglu" in fold  # a held stream: not written
            joined = x
            for j in joins:  # float32 sums in order
                joined = joined + j.astype(jnp.float32)
            x64 = np.asarray(joined, np.float64)
        h = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps) * np.asarray(ns, np.float64)
    elif "gate_up" in fold:
        offset = 32
        x = jax.random.normal(keys[0], (m, offset + 2 * k + 16), jnp.float32)
        x = x.astype(jnp.bfloat16)
        kw["gate_up"] = offset
        g, u = (np.asarray(x[:, offset + i * k : offset + (i + 1) * k], np.float64) for i in (0, 1))
        h = g / (1 + np.exp(-g)) * u
    else:
        h = np.asarray(x, np.float64)
    if "residual" in fold:
        kw["residual"] = 50.0 * jax.random.normal(keys[2], (m, n), jnp.float32)
    kw["swiglu"] = "swiglu" in fold
    got = jax.jit(
        lambda x, w, s: matvec.small_m_matmul(x, w, s, dtype=jnp.bfloat16, interpret=True, **kw)
    )(x, w, scale)
    if "joins" in fold:  # the stream with the outputs joined, exactly as XLA adds them
        got, stream = got
        if kw["write_stream"]:
            np.testing.assert_array_equal(stream, joined)
        else:
            assert stream is None
    want = _bf16(h) @ np.asarray(w, np.float64)
    if scale is not None:
        want = want * np.asarray(scale, np.float64)
    atol = 2.0**-8 * np.abs(want).max() + 1e-3
    if "swiglu" in fold:  # of the gate's and the up projection's outputs, each rounded
        g, u = _bf16(want[:, : n // 2]), _bf16(want[:, n // 2 :])
        want = g / (1 + np.exp(-g)) * u
        atol = 2.0**-8 * np.abs(want).max() + 2.0**-8 * np.abs(u).max() + 1e-3
    if "residual" in fold:
        assert got.dtype == jnp.float32
        want = np.asarray(kw["residual"], np.float64) + want
    else:
        assert got.dtype == jnp.bfloat16
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)  # the matmul's scale, not the sum's


def _unfused(
    x,
    w,
    scale=None,
    *,
    dtype=None,
    norm=None,
    gate_up=None,
    residual=None,
    joins=None,
    write_stream=True,
    swiglu=False,
    **_,
):
    """What `matvec.small_m_matmul` computes, spelled out in XLA ops (None where its plan
    refuses), so that a CPU model can take the folded decoding path."""
    dtype = jnp.dtype(dtype or x.dtype)
    k, n = w.shape
    p = matvec.plan(x.shape[0], k, n, dtype, w.dtype, tiles=2 if swiglu else 1)
    if p is None or (swiglu and (p.splits > 1 or (n // 2) % p.block_n)):
        return None
    f32 = jnp.float32
    stream = None
    if joins is not None:
        stream = x
        for j in joins if isinstance(joins, tuple) else (joins,):
            stream = stream + j.astype(f32)
    if norm is not None:
        h = x.astype(f32) if stream is None else stream
        h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + norm[1])
        h = h * norm[0].astype(f32)
    elif gate_up is not None:
        g, u = x[:, gate_up : gate_up + k].astype(f32), x[:, gate_up + k : gate_up + 2 * k]
        h = jax.nn.silu(g) * u.astype(f32)
    else:
        h = x
    y = h.astype(dtype).astype(f32) @ w.astype(f32)
    y = (y if scale is None else y * scale).astype(dtype)
    if swiglu:
        g, u = y[:, : n // 2].astype(f32), y[:, n // 2 :].astype(f32)
        y = (jax.nn.silu(g) * u).astype(dtype)
    y = y if residual is None else residual + y.astype(f32)
    if joins is None:
        return y
    return y, stream if write_stream else None


@pytest.mark.parametrize(
    "tp, residual, folds",  # over two layers (hybrid: three): two modules each
    [
        (1, "standard", dict(norm=4, swiglu=2, residual=4, joins=0, held=0)),  # epilogues
        (2, "standard", dict(norm=4, swiglu=2, residual=0, joins=3, held=1)),  # all-reduces
        (1, "ladder", dict(norm=4, swiglu=2, residual=0, joins=2, held=1)),  # joins later
        (2, "parallel", dict(norm=2, gate_up=2, residual=0, joins=1, held=0)),  # one norm
        (2, "upper_bound", dict(norm=4, swiglu=2, residual=0, joins=3, held=1)),  # as standard
        (2, "hybrid", dict(norm=6, swiglu=3, residual=0, joins=4, held=1)),  # 2 standard, 1 ladder
    ],
)
def test_folded_decoding_equals_the_unfused_program(monkeypatch, tp, residual, folds):
    """A decoding clone whose linear layers take the Triton path (here the kernel's arithmetic
    in XLA ops, `_unfused`) folds each norm into its input projection, silu(gate) * up into
    the down projection and, where nothing sits between (tp 1 or upper_bound, immediate
    modules), the residual adds into the output projections, elsewhere the pending output into
    the next norm's prologue (`joins`): the cached forward of a token equals the same clone's
    unfolded (XLA) program, and the folds are where they should be (counted per kind)."""
    from ladder_jax.inference.cache import KVCache
    from ladder_jax.model.transformer import fuse_inputs
    from tests.helpers import tiny_model

    layers = dict(residual="ladder", ladder_layers=1, n_layers=3) if residual == "hybrid" else {}
    layers = {"residual": residual, "n_layers": 2, **layers}
    model = fuse_inputs(tiny_model(tp, dtype="bfloat16", **layers))
    cfg = model.config
    calls = dict.fromkeys(folds, 0)

    def counted(*a, **kw):
        kw = {**kw, "held": None if kw.get("write_stream", True) else True}
        kw["swiglu"] = kw.get("swiglu") or None
        for name in calls:
            calls[name] += kw.get(name) is not None
        return _unfused(*a, **kw)

    monkeypatch.setattr(matvec, "small_m_matmul", counted)
    step = jnp.array([[7], [8]], jnp.int32)

    @nnx.jit
    def run(model, cache):  # a token's step at slot 4 of a cache that holds zeros
        return model.forward_cached(step, jnp.full((2, 1), 4, jnp.int32), cache)[0]

    def logits(matmul):
        for lin in quant.linears(model):
            lin.matmul = matmul
        cache = KVCache.init(cfg, model.mesh, 2, 16)
        return np.asarray(run(model, cache.layers()), np.float64)

    want, got = logits("xla"), logits("pallas")
    assert cfg.n_layers == layers["n_layers"] and calls == folds, calls
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0**-6 * np.abs(want).max())
