"""Attention arithmetic, no weights: RoPE, the KV cache write, grouped-query attention over keys
or a cache, causal flash attention on the platform's kernel (`attention_kernel`). Dimension
letters and the cache layout: docs/architecture.md, 'The model', 'The KV cache layout'.

    out_btnh = attend_causal(q_btnh, k_btkh, v_btkh, attention_kernel(mesh, dtype, H))"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax.experimental.pallas.ops.gpu import attention as pallas_attention
from jax.sharding import Mesh

from ladder_jax.config import ModelConfig
from ladder_jax.model import paged, ragged
from ladder_jax.model.collectives import vary_like


def rope_frequencies(config: ModelConfig) -> jax.Array:
    """Inverse frequencies (H/2,), with llama-3 scaling when configured."""
    H = config.head_dim
    inv = 1.0 / (config.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    sc = config.rope_scaling
    if sc is None:
        return inv
    wavelen = 2 * math.pi / inv
    low_wavelen = sc.original_max_len / sc.low_freq_factor  # longer than this: fully scaled
    high_wavelen = sc.original_max_len / sc.high_freq_factor  # shorter than this: untouched
    smooth = (sc.original_max_len / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    mid = (1 - smooth) * inv / sc.factor + smooth * inv
    return jnp.where(
        wavelen > low_wavelen, inv / sc.factor, jnp.where(wavelen < high_wavelen, inv, mid)
    )


def apply_rope(x_btnh, positions_bt, inv_freq):
    """Rotate the two halves of each head (the Llama / Hugging Face layout)."""
    angles = positions_bt[:, :, None].astype(jnp.float32) * inv_freq  # B T H/2
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_btnh.dtype)


def attend_rotated(q_btnh, k_btkh, v_btkh, positions_bt, inv_freq, kernel: str, cache=None):
    """Attention from projected q, k, v: RoPE, the cache write (row b's T new entries at slots
    positions[b, 0]...), then causal flash attention over the call's own keys
    (`positions_bt=None`: positions 0..T-1, a training sequence or a prefill), the reference
    `attend` over them (positions, no cache), or `ragged.attend_filled` over the filled part
    of the cache. Returns (out_btnh, the cache with the new entries, or None).

    With a cache, a negative position -(p + 1) marks a row that does not decode in this step
    (a server's idle row): its entries are written from slot p on and it attends to nothing
    (its output is zeros), so it neither lengthens the attention loop nor touches slots below
    p (`idle_positions`)."""
    B, T = q_btnh.shape[:2]
    from_start = positions_bt is None
    if from_start:
        positions_bt = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    idle_bt = None
    if cache is not None and not from_start:
        idle_bt = positions_bt < 0
        seen_bt = jnp.where(idle_bt, -1, positions_bt)
        positions_bt = jnp.where(idle_bt, -positions_bt - 1, positions_bt)
    q_btnh = apply_rope(q_btnh, positions_bt, inv_freq)
    k_btkh = apply_rope(k_btkh, positions_bt, inv_freq)
    if cache is not None and len(cache) == 3:  # a paged cache: (k pool, v pool, table)
        k_pool, v_pool, table_bm = cache
        cache = (
            paged.write(k_pool, k_btkh, positions_bt, table_bm, keys=True),
            paged.write(v_pool, v_btkh, positions_bt, table_bm, keys=False),
            table_bm,
        )
    elif cache is not None:
        cache = (
            write_cache(cache[0], k_btkh, positions_bt[:, 0], keys=True),
            write_cache(cache[1], v_btkh, positions_bt[:, 0], keys=False),
        )
    if from_start:
        out_btnh = attend_causal(q_btnh, k_btkh, v_btkh, kernel)
    elif cache is None:
        out_btnh = attend(q_btnh, k_btkh, v_btkh, positions_bt, positions_bt)
    else:
        over = paged.attend if len(cache) == 3 else ragged.attend_filled
        out_btnh = over(q_btnh, *cache, seen_bt, kernel)
        out_btnh = jnp.where(idle_bt[:, :, None, None], 0, out_btnh).astype(out_btnh.dtype)
    return out_btnh, cache


def idle_positions(positions_bt):
    """Where rows write with `attend_rotated`'s idle convention: -(p + 1) -> p, others as
    they are."""
    return jnp.where(positions_bt < 0, -positions_bt - 1, positions_bt)


def write_cache(cache, new_btkh, start_b, *, keys: bool):
    """Writes row b's T new entries at slots start[b]... in place (under donation), into keys
    laid out (B, K, H, S) or values (B, K, S, H) (`sharding.CACHE_BKSH`). Like every dynamic
    update in XLA it clamps out-of-range starts: callers check lengths on the host."""

    def row(c, n_tkh, start):
        n = n_tkh.transpose(1, 2, 0) if keys else n_tkh.swapaxes(0, 1)  # (K, H, T) / (K, T, H)
        return jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), start, 2 if keys else 1)

    return jax.vmap(row)(cache, new_btkh, start_b)


def attend_cache(q_btnh, k_bkhs, v_bksh, q_pos_bt, k_pos_bs):
    """`attend` over a KV cache laid out as `sharding.CACHE_BKSH` says: keys (B, K, H, S),
    values (B, K, S, H). The same arithmetic, as two matmuls batched over (B, K) that read the
    cache where it lies, written as `dot_general`s so that the operands keep this order (an
    einsum is free to swap them into a transposed product, which XLA:CPU runs much slower):
    queries (G*T, H) x keys (H, S), then the unnormalized exponentials (G*T, S) x values
    (S, H), divided by their row sums afterwards: G*T x H divisions rather than G*T x S, the
    cheaper side whenever S > H (docs/results.md has the timings)."""
    B, T, N, H = q_btnh.shape
    K = k_bkhs.shape[1]
    G = N // K
    q_bkmh = q_btnh.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    batch = ((0, 1), (0, 1))
    scores_bkms = jax.lax.dot_general(
        q_bkmh, k_bkhs, (((3,), (2,)), batch), preferred_element_type=jnp.float32
    ) / math.sqrt(H)
    visible_bts = k_pos_bs[:, None, :] <= q_pos_bt[:, :, None]
    visible_bms = jnp.broadcast_to(visible_bts[:, None], (B, G, T, visible_bts.shape[-1]))
    scores_bkms = jnp.where(visible_bms.reshape(B, 1, G * T, -1), scores_bkms, -1e30)
    # the max only keeps exp in range: its gradient cancels, so none flows through it
    exp_bkms = jnp.exp(scores_bkms - jax.lax.stop_gradient(scores_bkms.max(-1, keepdims=True)))
    out_bkmh = jax.lax.dot_general(
        exp_bkms.astype(v_bksh.dtype),
        v_bksh,
        (((3,), (2,)), batch),
        preferred_element_type=jnp.float32,
    )
    out_bkmh = (out_bkmh / exp_bkms.sum(-1, keepdims=True)).astype(v_bksh.dtype)
    return out_bkmh.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def attend(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs):
    """Causal grouped-query attention: query t sees key s iff k_pos[s] <= q_pos[t]. The
    reference: it materializes the (T, S) scores. Used with explicit positions and no cache:
    the keys and values of the call itself, (B, S, K, H), put in the cache's order and
    attended by `attend_cache` (the one copy of the arithmetic)."""
    return attend_cache(
        q_btnh, k_bskh.transpose(0, 2, 3, 1), v_bskh.transpose(0, 2, 1, 3), q_pos_bt, k_pos_bs
    )


# ---------------------------------------------------------------------------------------------
# Flash attention: softmax(QK^T)V of T queries over their own T keys, causal, grouped-query,
# without the (T, T) scores in memory where the platform has a kernel for it. ("Fused" in this
# package means the fused inputs of decoding, `fuse_inputs`, never this kernel.)

ATTENTION_KERNELS = ("matmul", "xla", "cudnn", "pallas")


def attention_kernel(mesh: Mesh, dtype, head_dim: int) -> str:
    """The flash-attention kernel for a model on `mesh`, chosen once when the model is built:

    - "cudnn": a running NVIDIA GPU backend, bf16 / fp16 and head_dim a multiple of 8 up to
      128 (cuDNN's flash attention through `jax.nn.dot_product_attention`).
    - "pallas": other GPU cases, and every deviceless GPU compile (a GPU mesh on a host whose
      backend is not a GPU, `ladder_jax.analysis.programs`): jax's Pallas (Triton) flash
      attention, forward and backward. cuDNN's kernel cannot be compiled deviceless (jax needs
      cuDNN itself at compile time), so the deviceless programs hold this one instead, as one
      `__gpu$xla.gpu.triton` custom call per pass.
    - "matmul": CPU (and anything else): the reference arithmetic (`attend`, two matmuls
      batched over (B, K) around the masked softmax), per block of queries over the keys the
      block can see (`causal_blocks`). XLA:CPU runs it faster than
      `jax.nn.dot_product_attention`'s XLA implementation, kernel "xla" (fewer transposes of
      the (T, T) scores; the same results to ~1e-6 in fp32), which stays selectable.
    """
    platform = mesh.devices.flat[0].platform
    if platform not in ("gpu", "cuda"):
        return "matmul"
    running = jax.default_backend() in ("gpu", "cuda")
    if (
        running
        and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        and head_dim % 8 == 0
        and head_dim <= 128
    ):
        return "cudnn"
    return "pallas"


# The "matmul" kernel's query blocks: queries [start, stop) attend keys [0, stop) only, so the
# scores above the diagonal blocks are never computed (exact: they are masked to zero weight).
# Blocks of 64 queries, at most 8 blocks (longer sequences: longer blocks): the fastest on CPU
# (timings in docs/results.md).
CAUSAL_BLOCK, CAUSAL_BLOCKS_MAX = 64, 8


def causal_blocks(T: int) -> list[tuple[int, int]]:
    """The (start, stop) query blocks of the "matmul" kernel over T positions."""
    size = max(CAUSAL_BLOCK, -(-T // CAUSAL_BLOCKS_MAX))
    size = -(-size // CAUSAL_BLOCK) * CAUSAL_BLOCK
    return [(s, min(s + size, T)) for s in range(0, T, size)]


def attend_causal(q_btnh, k_btkh, v_btkh, kernel: str = "xla"):
    """Causal grouped-query self-attention, query t over keys 0..t, through `kernel`
    (`attention_kernel`). The Pallas kernel tiles T in blocks of 128 (Triton blocks are
    powers of two of at least 16): T must be a multiple of 128 or one of 16, 32, 64; other
    lengths fall back to XLA's implementation."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}: one of {ATTENTION_KERNELS}")
    B, T, N, H = q_btnh.shape
    if kernel == "matmul":
        positions_bt = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        outs = []
        for start, stop in causal_blocks(T):  # each block of queries over the keys it can see
            outs.append(
                attend(
                    q_btnh[:, start:stop],
                    k_btkh[:, :stop],
                    v_btkh[:, :stop],
                    positions_bt[:, start:stop],
                    positions_bt[:, :stop],
                )
            )
        return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    if kernel == "pallas" and (T % _PALLAS_BLOCKS.block_q == 0 or T in (16, 32, 64)):
        G = N // k_btkh.shape[2]  # the kernel wants as many kv heads as query heads
        k_btnh, v_btnh = (jnp.repeat(t, G, axis=2) for t in (k_btkh, v_btkh))
        return pallas_flash(q_btnh, k_btnh, v_btnh, 1.0 / math.sqrt(H))
    return jax.nn.dot_product_attention(
        q_btnh,
        k_btkh,
        v_btkh,
        is_causal=True,
        implementation="cudnn" if kernel == "cudnn" else "xla",
    )


# jax's Pallas flash attention (`jax.experimental.pallas.ops.gpu.attention.mha`), wrapped for
# use inside the model's shard_map. Footgun: its pallas_calls declare outputs (the softmax
# statistics, the gradients) without a varying-manual-axes type, which shard_map's
# `check_vma=True` refuses; so the kernel's own forward and backward run with the check off
# and their results are cast back to their inputs' types. This reaches into jax internals
# (`_mha_forward`, `_mha_backward`, `config._check_vma`) of the pinned jax version;
# tests/test_attention.py compiles it (deviceless) and runs it (interpreted on CPU).
_PALLAS_BLOCKS = pallas_attention.BlockSizes.get_default()
_PALLAS_ARGS = {
    "block_sizes": _PALLAS_BLOCKS,
    "backward_pass_impl": "triton",
    "num_warps": None,
    "num_stages": 2,
    "grid": None,
    "debug": False,
    "return_residuals": False,
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def pallas_flash(q_btnh, k_btnh, v_btnh, scale: float, interpret: bool = False):
    """Causal flash attention (Pallas / Triton), equal head counts; `interpret=True` runs the
    kernel through Pallas's interpreter (any platform, slow: for tests)."""
    return _pallas_fwd(q_btnh, k_btnh, v_btnh, scale, interpret)[0]


def _pallas_fwd(q_btnh, k_btnh, v_btnh, scale, interpret):
    a = dict(_PALLAS_ARGS, interpret=interpret)
    with jax_config._check_vma(False):
        out_btnh, res = pallas_attention._mha_forward(
            q_btnh,
            k_btnh,
            v_btnh,
            None,
            scale,
            True,
            a["block_sizes"],
            a["backward_pass_impl"],
            a["num_warps"],
            a["num_stages"],
            a["grid"],
            a["interpret"],
            a["debug"],
            a["return_residuals"],
        )
    return vary_like(out_btnh, q_btnh), res


def _pallas_bwd(scale, interpret, res, ct_btnh):
    a = dict(_PALLAS_ARGS, interpret=interpret)
    q_btnh, k_btnh, v_btnh = res[:3]
    with jax_config._check_vma(False):
        ct_q, ct_k, ct_v, _ = pallas_attention._mha_backward(
            scale,
            True,
            a["block_sizes"],
            a["backward_pass_impl"],
            a["num_warps"],
            a["num_stages"],
            a["grid"],
            a["interpret"],
            a["debug"],
            a["return_residuals"],
            res,
            ct_btnh,
        )
    return vary_like(ct_q, q_btnh), vary_like(ct_k, k_btnh), vary_like(ct_v, v_btnh)


pallas_flash.defvjp(_pallas_fwd, _pallas_bwd)
