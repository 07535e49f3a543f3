"""Decode attention over the filled slots only (`ladder_jax.model.ragged`) against the plain
reference (`tests.reference.cache_attention`) and the full forward.

Every check poisons the slots the attention must not read with NaN: masking them (the
reference arithmetic over the whole cache, `attend_cache`) would still read them and turn
every output NaN, so these checks fail unless the blocks past the filled ones are skipped.
Tolerance: float32, 1e-5 absolute on attention outputs of unit-variance inputs, 1e-4 on
logits.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ladder_jax.analysis import compiled, hlo, programs
from ladder_jax.analysis.kernels import read_kernels
from ladder_jax.inference.cache import KVCache
from ladder_jax.model import attention, ragged, transformer
from tests import helpers, reference

B, N, K, H, S = 4, 8, 2, 16, 200  # S not a multiple of the block (16): the last one overlaps


def _inputs(T, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (B, T, N, H)),
        jax.random.normal(keys[1], (B, K, H, S)),
        jax.random.normal(keys[2], (B, K, S, H)),
    )


def _poison(k_bkhs, v_bksh, first_unread_b):
    """NaN in every slot from first_unread[b] on, in row b's keys and values."""
    slot = jnp.arange(S)
    bad_bs = slot[None, :] >= jnp.asarray(first_unread_b)[:, None]
    return (
        jnp.where(bad_bs[:, None, None, :], jnp.nan, k_bkhs),
        jnp.where(bad_bs[:, None, :, None], jnp.nan, v_bksh),
    )


@pytest.mark.parametrize(
    "kernel,split_min_blocks",
    [("matmul", None), ("pallas", ragged.SPLIT_MIN_BLOCKS), ("pallas", 1)],
)
@pytest.mark.parametrize("T", [1, 3])
def test_ragged_decode_attention_equals_the_reference(kernel, split_min_blocks, T, monkeypatch):
    """Rows of different lengths (one slot, a block's last slot, the next block's first, the
    cache's last) and T queries per row (4 T of a kv head: fewer than Triton's 16 rows). The
    XLA loop ("matmul") reads the blocks the longest row needs; the Pallas kernel
    (interpreted) each row's own blocks, in one split (its output written as the queries lie)
    or, with `SPLIT_MIN_BLOCKS` 1, one split per block combined afterwards (splits past a short
    row's blocks see nothing)."""
    if split_min_blocks is not None:
        monkeypatch.setattr(ragged, "SPLIT_MIN_BLOCKS", split_min_blocks)
    q, k, v = _inputs(T)
    block = ragged.key_block(S)
    last_b = np.array([0, block - 1, block, S - 1])
    if kernel == "matmul":
        last_b[3] = 3 * block + 2  # the longest row: its block ends the reading
    pos_bt = jnp.asarray(np.maximum(last_b[:, None] - np.arange(T)[::-1], 0), jnp.int32)
    read_b = -(-(last_b + 1) // block) * block  # the end of each row's last block
    if kernel == "matmul":
        read_b = np.full(B, read_b.max())
    k, v = _poison(k, v, np.minimum(read_b, S))
    got = jax.jit(lambda *a: ragged.attend_filled(*a, kernel=kernel, interpret=True))(
        q, k, v, pos_bt
    )
    want = reference.cache_attention(q, k, v, np.asarray(pos_bt))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("split_min_blocks", [ragged.SPLIT_MIN_BLOCKS, 1])
def test_rope_and_the_cache_write_inside_the_kernel_equal_the_xla_ops(
    split_min_blocks, monkeypatch
):
    """`attend_new` (interpreted) from the projection's rows as they lie == the XLA ops
    (`apply_rope`, `write_cache`) then the float64 reference over the written cache. Rows at
    slot 0, a block's last slot, the next block's first and the cache's last slot; one split
    or one per block. Slots no query may read from memory hold NaN: from the end of each row's
    last block below its position, which for a row at a block's first slot (or slot 0) is that
    slot itself (so the kernel must write it and fold the new token in from registers). Away
    from the written slots the caches come back bit for bit."""
    monkeypatch.setattr(ragged, "SPLIT_MIN_BLOCKS", split_min_blocks)
    Hr = 32  # each rotated half a Triton block
    keys = jax.random.split(jax.random.key(1), 3)
    rows = jax.random.normal(keys[0], (B, N + 2 * K, Hr))
    k = jax.random.normal(keys[1], (B, K, Hr, S))
    v = jax.random.normal(keys[2], (B, K, S, Hr))
    block = min(ragged.key_block(S), ragged.PALLAS_BLOCK)
    pos_b = np.array([0, block - 1, block, S - 1])
    k, v = _poison(k, v, -(-pos_b // block) * block)
    pos_bt = jnp.asarray(pos_b[:, None], jnp.int32)
    inv = attention.rope_frequencies(dataclasses.replace(helpers.TINY, head_dim=Hr))
    out, (k_got, v_got) = jax.jit(
        lambda *a: ragged.attend_new(*a[:1], 0, N, *a[1:], interpret=True)
    )(rows, pos_bt, inv, k, v)
    q_new = attention.apply_rope(rows[:, None, :N], pos_bt, inv)
    k_new = attention.apply_rope(rows[:, None, N : N + K], pos_bt, inv)
    k_want = attention.write_cache(k, k_new, pos_bt[:, 0], keys=True)
    v_want = attention.write_cache(v, rows[:, None, N + K :], pos_bt[:, 0], keys=False)
    np.testing.assert_allclose(np.asarray(k_got), np.asarray(k_want), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(v_got), np.asarray(v_want))
    slot = np.arange(S)[None, :] != pos_b[:, None]
    np.testing.assert_array_equal(
        np.asarray(k_got).transpose(0, 3, 1, 2)[slot], np.asarray(k).transpose(0, 3, 1, 2)[slot]
    )
    want = reference.cache_attention(q_new, np.asarray(k_want), np.asarray(v_want), pos_b[:, None])
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=0)


NO_CHECK = dict(check_vma=False)


@pytest.mark.parametrize(
    "tp, residual, d_ff", [(1, "standard", 128), (2, "parallel", 128), (2, "parallel", 136)]
)
def test_decode_with_rope_and_the_cache_write_in_the_kernel_equals_the_xla_ops(
    tp, residual, d_ff, monkeypatch
):
    """The model's decode step with the attention on the Triton kernel (`attend_new`,
    interpreted: RoPE and the cache write inside it, fed the fused q/k/v projection's output;
    parallel's five-way q/k/v/gate/up projection whole, unsplit, even where its width is no
    multiple of the head width: d_ff 136, 68 gate and 68 up columns a rank) == the same
    model's XLA ops (`apply_rope`, `write_cache`, `attend_filled`): logits and both caches.
    Rows at slot 0, a block's last and next slots and the cache's last slot, over a cache of
    random entries."""
    model = helpers.tiny_model(tp, residual=residual, head_dim=32, n_layers=2, d_ff=d_ff)
    model = transformer.fuse_inputs(model)
    n, kv, f = transformer.fused_input_columns(model.config, tp)
    width = (n + 2 * kv) * 32 + (2 * f if residual == "parallel" else 0)
    cfg, S = model.config, 64
    pos_b1 = jnp.asarray([[0], [15], [16], [S - 1]], jnp.int32)
    tokens = jnp.asarray([[3], [5], [7], [11]], jnp.int32)
    empty = KVCache.init(cfg, model.mesh, B, S)
    layers = [
        tuple(
            jax.device_put(jax.random.normal(jax.random.key(10 * i + j), x.shape), x.sharding)
            for j, x in enumerate(kv)
        )
        for i, kv in enumerate(empty.layers())
    ]
    step = nnx.jit(lambda m, c: m.forward_cached(tokens, pos_b1, c))
    want_logits, want_cache = step(model, layers)
    calls = []

    def interpreted(*a, **kw):
        calls.append(a[0].shape)
        return attend_new(*a, **kw, interpret=True)

    attend_new, shard_map = ragged.attend_new, jax.shard_map
    monkeypatch.setattr(ragged, "attend_new", interpreted)
    # Pallas's interpreter cannot run under shard_map's type check (the compiled H100
    # programs above hold the kernel with the check on)
    monkeypatch.setattr(jax, "shard_map", lambda *a, **kw: shard_map(*a, **kw | NO_CHECK))
    for layer in model.layers:
        layer.attn.kernel = "pallas"
    got_logits, got_cache = step(model, layers)
    assert calls == [(B, width)] * cfg.n_layers  # the projection whole, as one operand
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-4)
    for got, want in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


def test_a_head_width_triton_cannot_block_takes_the_xla_loop():
    """Triton's block shapes are powers of two: a head width of 24 (a 3b-like model's 72
    alike) runs the XLA loop even where the model asks for the kernel, and still equals the
    reference attention; a width of 16 runs the kernel."""
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (
        jax.random.normal(keys[0], (2, 1, 4, 24)),
        jax.random.normal(keys[1], (2, 2, 24, 64)),
        jax.random.normal(keys[2], (2, 2, 64, 24)),
    )
    pos_bt = jnp.asarray([[5], [40]], jnp.int32)
    f = lambda *a: ragged.attend_filled(*a, kernel="pallas", interpret=True)  # noqa: E731
    assert "pallas_call" not in str(jax.make_jaxpr(f)(q, k, v, pos_bt))
    np.testing.assert_allclose(
        np.asarray(jax.jit(f)(q, k, v, pos_bt)),
        reference.cache_attention(q, k, v, np.asarray(pos_bt)),
        atol=1e-5,
        rtol=0,
    )
    q16, k16, v16 = q[..., :16], k[:, :, :16], v[..., :16]
    assert "pallas_call" in str(jax.make_jaxpr(f)(q16, k16, v16, pos_bt))


@pytest.mark.parametrize("tp", [1, 4])
def test_cached_decode_of_a_ragged_batch_equals_the_full_forward(tp):
    """Prompts of 3, 20, 1 and 37 tokens prefilled into a 256-slot cache (blocks of 32), then
    6 decode steps with each row at its own position: every step's logits == the full forward
    of the rows' whole sequences (causal: position p sees tokens <= p). The slots past the
    longest row's two blocks hold NaN."""
    model = helpers.tiny_model(tp, residual="ladder")
    lengths, steps, longest = np.array([3, 20, 1, 37]), 6, 37
    seqs = np.random.default_rng(0).integers(0, model.config.vocab_size, (B, longest + steps))
    seqs = seqs.astype(np.int32)
    prompt = np.where(np.arange(longest)[None] < lengths[:, None], seqs[:, :longest], 0)
    step_fn = nnx.jit(lambda m, t, p, c: m.forward_cached(t, p, c))
    cache = KVCache.init(model.config, model.mesh, B, 256)
    unread = ragged.key_block(256) * 2  # the longest row ends at slot 42 < 64
    cache = KVCache(
        *(
            tuple(_poison_slots(x, unread, axis) for x in xs)
            for xs, axis in ((cache.k, 3), (cache.v, 2))
        )
    )
    _, layers = step_fn(model, prompt, None, cache.layers())
    got = []
    for i in range(steps):
        pos_b = (lengths + i).astype(np.int32)
        logits, layers = step_fn(model, seqs[np.arange(B), pos_b][:, None], pos_b[:, None], layers)
        got.append(np.asarray(logits)[:, 0])
    full = np.asarray(helpers.logits(model, seqs))
    want = np.stack([full[np.arange(B), lengths + i] for i in range(steps)])
    assert np.isfinite(want).all()
    np.testing.assert_allclose(np.stack(got), want, atol=1e-4, rtol=0)


def _poison_slots(x, first, axis):
    slot = jnp.arange(x.shape[axis]).reshape([-1 if a == axis else 1 for a in range(x.ndim)])
    return jax.device_put(jnp.where(slot >= first, jnp.nan, x), x.sharding)


def test_the_h100_decode_step_holds_the_ragged_kernel_per_layer():
    """The deviceless H100 decode program attends through one `ragged_decode_attention`
    Triton call per layer, whose cache operands are the cache as it lies (no copy)."""
    config = helpers.TINY
    hlo = programs.compile_program(
        config, phase="decode", tp=2, batch=8, seq=32, new_tokens=32, cache=False
    )[0]
    calls = [
        line for line in hlo.splitlines() if "xla.gpu.triton" in line and ragged.KERNEL_NAME in line
    ]
    assert len(calls) == config.n_layers


def test_the_kernel_compiles_for_h100_at_llama_shapes_with_tensor_core_dots():
    """16 rows, 8 kv heads of 4 queries each, head_dim 128, 8192 bf16 slots: one Triton call
    (the `dot` form the tiny preset's head_dim 8 does not take) and the splits' combine."""
    mesh = programs.gpu_mesh("h100", 1)
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def arg(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharded)

    hlo = (
        jax.jit(lambda *a: ragged.attend_filled(*a, kernel="pallas"))
        .lower(
            arg((16, 1, 32, 128)),
            arg((16, 8, 128, 8192)),
            arg((16, 8, 8192, 128)),
            arg((16, 1), jnp.int32),
        )
        .compile()
        .as_text()
    )
    calls = [
        line for line in hlo.splitlines() if ragged.KERNEL_NAME in line and "custom-call(" in line
    ]
    assert len(calls) == 1


# a llama-like GQA (4 query heads a kv head) at small widths, decoded at batch 16 on tp 8:
# each rank holds one kv head and its 4 query heads, fewer than the 16 rows Triton's dot needs
# (head_dim 32: the kernel's tensor-core form)
GQA = dataclasses.replace(
    helpers.TINY,
    d_model=1024,
    n_heads=32,
    n_kv_heads=8,
    head_dim=32,
    d_ff=2048,
    vocab_size=2000,
    n_layers=2,
    max_seq_len=4096,
    dtype="bfloat16",
    param_dtype="bfloat16",
    residual="standard",
    decode_matmul="pallas",
)


@pytest.mark.parametrize("prompt_len", [128, 1920])
def test_the_decode_attention_moves_the_cache_and_little_else_at_batch_16(prompt_len):
    """The kernels of the H100 decode step between the q/k/v matmul and the o matmul: the
    ragged kernel alone (RoPE and the cache writes inside it, reading q/k/v as the matmul
    wrote them), plus the splits' combine where the cache is split (the long prompt). They
    move the filled KV cache, one pass over the q/k/v and o activations, the new token's
    slot of each cache, and where split one write and one read of the float32 partials of
    the real query rows: no query rows padded to Triton's 16 in memory."""
    tp, B, new = 8, 16, 64
    text, _ = programs.compile_program(
        GQA, phase="decode", tp=tp, batch=B, seq=prompt_len, new_tokens=new, cache=False
    )
    fill = compiled.decode_fill(GQA, compiled.Workload(tp, B, prompt_len, new))
    module = hlo.Module(text)
    ops = {op.name: op for op in module.entry}
    kernels = [
        k
        for k in read_kernels(text, devices=tp, filled=fill)
        if k.kind == "compute" and k.layer == GQA.n_layers - 1
    ]
    matmuls = [i for i, k in enumerate(kernels) if hlo.SMALL_M_MATMUL in ops[k.name].text]
    side = kernels[matmuls[0] + 1 : matmuls[1]]  # after q/k/v, before o
    H, n, kv = GQA.head_dim, GQA.n_heads // tp, GQA.n_kv_heads // tp
    cache = B * kv * (prompt_len + new // 2) * H * 2 * 2  # K and V of the filled slots, bf16
    activations = B * (2 * n + 2 * kv) * H * 2  # q, k, v in and o out, bf16
    (call,) = [ops[k.name] for k in side if ragged.KERNEL_NAME in ops[k.name].text]
    assert module.op("ENTRY", call.operands[0]).elements == B * (n + 2 * kv) * H
    outputs = re.findall(r"f32\[(\d+),(\d+),(\d+),(\d+),(\d+)\]", call.shape)
    splits = int(outputs[0][2]) if outputs else 1
    partials = 2 * splits * B * n * (H + 1) * 4 if splits > 1 else 0
    new_slots = 2 * B * kv * H * 2
    small = B * 4 + H // 2 * 4  # positions, RoPE frequencies
    extra = sum(k.nbytes for k in side) - cache
    assert 0 < extra <= activations + new_slots + small + partials, [
        (k.name, k.nbytes) for k in side
    ]
    assert (splits > 1) == (prompt_len > 1024)
    assert len(side) == (1 if splits == 1 else 2), [k.name for k in side]
