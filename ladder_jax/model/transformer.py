"""The Ladder Transformer: a Llama-style decoder with four residual schemes, in Flax NNX.

    model = Transformer(ModelConfig.from_preset("tiny", residual="ladder"), mesh=mesh,
                        rngs=nnx.Rngs(0))
    logits = nnx.jit(lambda m, t: m(t))(model, tokens)   # (B, T, V) float32, V split on tp

Embedding -> L layers of attention and SwiGLU MLP, each behind an RMSNorm -> RMSNorm -> head.
`__call__` is one `shard_map` over the model's mesh; the wiring of each scheme is
`ladder_jax.model.residual`, weight specs `ladder_jax.model.sharding`. Invariants: every scheme
shares one weight tree; tp N equals tp 1; `ladder_layers=0` is the standard program bit for
bit. Dimension letters, the layer diagram, the cache layout and the jax internals the Pallas
kernel relies on: docs/architecture.md. On GPUs compile with `sharding.jit`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src import config as jax_config
from jax.experimental.pallas.ops.gpu import attention as pallas_attention
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ladder_jax.config import ConfigError, ModelConfig
from ladder_jax.model import quant, ragged, residual, sharding
from ladder_jax.model.collectives import vary_like
from ladder_jax.model.linear import FusedInput, FusedLinear, FusesInputs, Linear
from ladder_jax.model.sharding import DATA, TP, WeightSpecs

# ---------------------------------------------------------------------------------------------
# Initialization: each weight is drawn directly into its sharding, from a key that depends only
# on its creation order, with a partitionable PRNG, so the global values never depend on the
# mesh and no host ever holds a whole weight.


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "std", "sharding"))
def _normal(key, *, shape, dtype, std, sharding):
    w = std * jax.random.normal(key, shape, jnp.float32)
    return jax.lax.with_sharding_constraint(w.astype(dtype), sharding)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "sharding"))
def _ones(*, shape, dtype, sharding):
    return jax.lax.with_sharding_constraint(jnp.ones(shape, dtype), sharding)


def _weight(
    rngs: nnx.Rngs, mesh: Mesh, shape, spec: P, dtype, std: float, fsdp_data: int = 1
) -> nnx.Param:
    """A weight drawn in place: `spec` is its tp layout (how the model reads it), `stored` where
    it lives, split over `data` too under FSDP (`WeightSpecs.fsdp`; read with
    `sharding.read_weight`)."""
    assert jax.config.jax_threefry_partitionable, "mesh-independent init needs it"
    stored = WeightSpecs.fsdp(spec, shape, fsdp_data)
    value = _normal(
        rngs.params(),
        shape=tuple(shape),
        dtype=jnp.dtype(dtype),
        std=std,
        sharding=NamedSharding(mesh, stored),
    )
    return nnx.Param(value, spec=spec, stored=stored)


def _linear(
    rngs: nnx.Rngs,
    mesh: Mesh,
    equation: str,
    shape,
    spec: P,
    config: ModelConfig,
    std: float,
    fsdp_data: int = 1,
    *,
    kv_heads=None,
    flat: bool = True,
) -> Linear:
    """A `Linear` of a weight drawn in place (`_weight`); with `config.quantize` the same draw,
    quantized in place (`ladder_jax.model.quant`). `flat`: on CPU meshes (`flat_matmuls`)."""
    w = _weight(rngs, mesh, shape, spec, config.param_dtype, std, fsdp_data)
    linear = Linear(
        w,
        equation,
        flat=flat and flat_matmuls(mesh),
        kv_heads=kv_heads,
        matmul=linear_matmul(mesh, config),
    )
    if config.quantize is not None:
        quant.quantize_linear(linear, mesh)
    return linear


# ---------------------------------------------------------------------------------------------
# Modules. Their __call__s run *inside* shard_map, on each rank's local shard of the weights.


class RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float, *, mesh: Mesh, specs: WeightSpecs, param_dtype):
        self.eps = eps
        stored = WeightSpecs.fsdp(specs.norm_d, (d,), specs.fsdp_data)
        self.scale = nnx.Param(
            _ones(shape=(d,), dtype=jnp.dtype(param_dtype), sharding=NamedSharding(mesh, stored)),
            spec=specs.norm_d,
            stored=stored,
        )

    def __call__(self, x_btd):
        x = x_btd.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return x * sharding.read_weight(self.scale, jnp.float32)


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


class Attention(FusesInputs):
    INPUTS, FUSED = ("q", "k", "v"), "qkv"

    def __init__(self, config: ModelConfig, *, mesh: Mesh, specs: WeightSpecs, rngs: nnx.Rngs):
        D, N, K, H = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        std_out = 0.02 / math.sqrt(2 * config.n_layers)
        fs = specs.fsdp_data
        kv = (K, sharding.tp_size(mesh)) if specs.kv_replicated else None  # its kv head
        self.q = _linear(rngs, mesh, "BTD,DNH->BTNH", (D, N, H), specs.q_dnh, config, 0.02, fs)
        self.k = _linear(
            rngs, mesh, "BTD,DKH->BTKH", (D, K, H), specs.kv_dkh, config, 0.02, fs, kv_heads=kv
        )
        self.v = _linear(
            rngs, mesh, "BTD,DKH->BTKH", (D, K, H), specs.kv_dkh, config, 0.02, fs, kv_heads=kv
        )
        self.o = _linear(rngs, mesh, "BTNH,NHD->BTD", (N, H, D), specs.o_nhd, config, std_out, fs)
        self.qkv = None  # decoding: their `FusedLinear` (`install_fused`)
        self.kv_replicated = specs.kv_replicated
        self.dtype = config.dtype
        self.kernel = attention_kernel(mesh, config.dtype, H)

    def __call__(
        self, x_btd, positions_bt, inv_freq, cache=None, *, norm=None, residual=None, joins=None
    ):
        """This rank's partial sum (B, T, D) of the attention output; with a KV cache
        (k, v), keys (B, K_local, H, S) and values (B, K_local, S, H), also the cache with
        this call's keys and values written at `positions_bt` (row b's tokens go to slots
        positions[b, 0] onwards).

        `positions_bt=None`: the tokens are at positions 0..T-1 (a training sequence, or a
        prompt written from slot 0 of the cache: the prefill). Attention then runs as one
        causal flash kernel over the T keys of the call itself (`attend_causal`): the same
        result as attending over the cache, whose slots past t no query t may see. With
        positions given, it runs the reference `attend` over the keys, or over a cache
        `ragged.attend_filled`, which reads only the slots some query can see; a decode step
        on the Triton kernel runs RoPE, the cache write and attention as one kernel
        (`ragged.attend_new`) on the q/k/v projection's output as it lies.

        Decoding folds (`residual._decode_stream`): `norm` (the layer's `RMSNorm`), x_btd is
        the float32 stream, normalized first, after `joins` (a reduced output) joins it: then
        returns (the above, the joined stream); `residual`, the output is `residual + output`."""
        x_btd = x_btd if norm is not None else x_btd.astype(self.dtype)
        if self.qkv is not None and self._writes_in_kernel(x_btd.shape[1], positions_bt, cache):
            # the fused projection's output as it lies goes to the attention kernel
            y = self.qkv(x_btd, self.dtype, norm=norm, joins=joins, split=False)
            y_btc, stream = y if joins is not None else (y, None)
            out = self.attend_rows(y_btc, 0, positions_bt, inv_freq, cache, residual=residual)
            return out if joins is None else (out, stream)
        qkv = self.project_inputs(x_btd, self.dtype, norm=norm, joins=joins)
        (q_btnh, k_btkh, v_btkh), stream = qkv if joins is not None else (qkv, None)
        out = self.attend_and_project(
            q_btnh, k_btkh, v_btkh, positions_bt, inv_freq, cache, residual=residual
        )
        return out if joins is None else (out, stream)

    def attend_and_project(
        self, q_btnh, k_btkh, v_btkh, positions_bt, inv_freq, cache=None, *, residual=None
    ):
        """Everything after the q/k/v projections (RoPE, cache write, attention, the output
        projection); `__call__` documents the arguments. The parallel scheme's fused input
        projection (`Layer.fused_in`) enters at `attend_rows` on the Triton kernel, here
        elsewhere."""
        B, T, N, H = q_btnh.shape
        if self._writes_in_kernel(T, positions_bt, cache):
            # separate q/k/v: the kernel reads them from one buffer (a copy; the projections'
            # own callers hand over their unsplit output instead)
            rows = [x.reshape(B, -1, H) for x in (q_btnh, k_btkh, v_btkh)]
            y_btc = jnp.concatenate(rows, axis=1).reshape(B, T, -1)
            return self.attend_rows(y_btc, 0, positions_bt, inv_freq, cache, residual=residual)
        from_start = positions_bt is None
        if from_start:
            positions_bt = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        q_btnh = apply_rope(q_btnh, positions_bt, inv_freq)
        k_btkh = apply_rope(k_btkh, positions_bt, inv_freq)
        if cache is not None:
            new_cache = (
                write_cache(cache[0], k_btkh, positions_bt[:, 0], keys=True),
                write_cache(cache[1], v_btkh, positions_bt[:, 0], keys=False),
            )
        if from_start:
            out_btnh = attend_causal(q_btnh, k_btkh, v_btkh, self.kernel)
        elif cache is None:
            out_btnh = attend(q_btnh, k_btkh, v_btkh, positions_bt, positions_bt)
        else:
            # only the filled blocks of each row's cache are read (`ragged.attend_filled`)
            out_btnh = ragged.attend_filled(q_btnh, *new_cache, positions_bt, self.kernel)
        y_btd = self.o(out_btnh, self.dtype, residual=residual)
        return y_btd if cache is None else (y_btd, new_cache)

    def _writes_in_kernel(self, T, positions_bt, cache) -> bool:
        """Whether a step runs RoPE, the cache write and attention as one kernel
        (`ragged.attend_new`): decoding one token per row over a cache, on the Triton kernel."""
        return (
            cache is not None
            and positions_bt is not None
            and ragged.writes_in_kernel(self.kernel, T, cache[1])
        )

    def attend_rows(
        self, y_btc, q_col, positions_bt, inv_freq, cache, *, n_heads=None, residual=None
    ):
        """`attend_and_project` from a projection's output (B, 1, C) that holds the queries,
        keys and values one after another from column `q_col` (a multiple of the head width):
        `n_heads` query heads (this rank's), or None: q/k/v run to the output's end. Columns
        after them (the parallel scheme's gate and up) are not read. RoPE, the cache write
        and attention run in the one kernel `ragged.attend_new`, which reads them where the
        projection wrote them (no copy). Returns (output, cache)."""
        B, T, C = y_btc.shape
        H = cache[1].shape[-1]
        N = n_heads if n_heads is not None else C // H - q_col // H - 2 * cache[1].shape[1]
        out_btnh, new_cache = ragged.attend_new(
            y_btc.reshape(B, C), q_col // H, N, positions_bt, inv_freq, *cache
        )
        y_btd = self.o(out_btnh, self.dtype, residual=residual)
        return y_btd, new_cache


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


def flat_matmuls(mesh: Mesh) -> bool:
    """Whether the linear layers of a model on `mesh` run as 2-D matmuls (`linear.flat_einsum`):
    on CPU meshes, where XLA compiles that form's backward several times faster. GPU programs
    keep the einsums (what the overlap proofs and the performance model were built on)."""
    return mesh.devices.flat[0].platform == "cpu"


def linear_matmul(mesh: Mesh, config: ModelConfig) -> str:
    """The matmul of the model's linear layers over a few rows (`Linear.matmul`): the config's
    `decode_matmul` on GPU meshes (running or deviceless), XLA's on CPU meshes."""
    return config.decode_matmul if not flat_matmuls(mesh) else "xla"


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
# Blocks of 64 queries, at most 8 blocks (longer sequences: longer blocks). SmolLM2-135M's
# attention (batch 8 x 256, 9 / 3 heads of 64), forward and backward on a 2-core Xeon: 45 ms
# whole, 36 ms in 2 blocks, 21 ms in 4, 28 ms in 8 (blocks of 32), per layer.
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


class MLP(FusesInputs):
    INPUTS, FUSED = ("gate", "up"), "gate_up"

    def __init__(self, config: ModelConfig, *, mesh: Mesh, specs: WeightSpecs, rngs: nnx.Rngs):
        D, F = config.d_model, config.d_ff
        fs = specs.fsdp_data
        self.gate = _linear(rngs, mesh, "BTD,DF->BTF", (D, F), specs.up_df, config, 0.02, fs)
        self.up = _linear(rngs, mesh, "BTD,DF->BTF", (D, F), specs.up_df, config, 0.02, fs)
        self.down = _linear(
            rngs,
            mesh,
            "BTF,FD->BTD",
            (F, D),
            specs.down_fd,
            config,
            0.02 / math.sqrt(2 * config.n_layers),
            fs,
        )
        self.gate_up = None  # decoding: their `FusedLinear` (`install_fused`)
        self.dtype = config.dtype

    def __call__(self, x_btd, *, norm=None, residual=None, joins=None):
        """Returns this rank's partial sum (B, T, D) of the SwiGLU output. Decoding folds
        (`residual._decode_stream`): `norm` (the layer's `RMSNorm`), x_btd is the float32
        stream, normalized first, after `joins` (a reduced output) joins it: then returns
        (the output, the joined stream); `residual`, the output is `residual + output`."""
        if norm is None:
            x_btd = x_btd.astype(self.dtype)
        h = None
        if self.gate_up is not None and self.down.matmul == "pallas":  # silu * up in its kernel
            h = self.gate_up.swiglu(x_btd, self.dtype, norm=norm, joins=joins)
        if h is not None:
            h_btf, stream = h if joins is not None else (h, None)
            out = self.down(h_btf, self.dtype, residual=residual)
        elif self.gate_up is not None and self.down.matmul == "pallas":  # one kernel each
            gu = self.gate_up(x_btd, self.dtype, norm=norm, joins=joins, split=False)
            gu_btc, stream = gu if joins is not None else (gu, None)
            out = self.down_from(self.gate_up, gu_btc, 0, residual)
        else:
            gu = self.project_inputs(x_btd, self.dtype, norm, joins)
            (g_btf, u_btf), stream = gu if joins is not None else (gu, None)
            out = self.project_down(g_btf, u_btf, residual)
        return out if joins is None else (out, stream)

    def project_down(self, g_btf, u_btf, residual=None):
        """silu(gate) * up through the down projection (the parallel scheme's fused input
        projection enters here)."""
        return self.down(jax.nn.silu(g_btf) * u_btf, self.dtype, residual=residual)

    def down_from(self, fused: FusedLinear, y_btc, gate: int, residual=None):
        """`project_down` of parts `gate` and `gate + 1` of `fused`'s unsplit output: silu(gate)
        * up in the Triton kernel's prologue where the down projection runs on it."""
        out = None
        if self.down.matmul == "pallas":
            out = self.down.small_m(
                y_btc, self.dtype, gate_up=fused.offset(gate), residual=residual
            )
        if out is not None:
            return out
        parts = fused.split(y_btc)
        return self.project_down(parts[gate], parts[gate + 1], residual)


class Layer(FusesInputs):
    """Attention and MLP, each behind its norm. Decoding a parallel model fuses all five input
    projections, which read one normalized input, into `fused_in` (`install_fused`)."""

    INPUTS, FUSED = ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"), "fused_in"

    def __init__(self, config: ModelConfig, *, mesh: Mesh, specs: WeightSpecs, rngs: nnx.Rngs):
        kw = dict(mesh=mesh, specs=specs, param_dtype=config.param_dtype)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.attn = Attention(config, mesh=mesh, specs=specs, rngs=rngs)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.mlp = MLP(config, mesh=mesh, specs=specs, rngs=rngs)
        self.fused_in = None


class Transformer(nnx.Module):
    """The decoder. `model(tokens)` maps int32 tokens (B, T) to float32 logits (B, T, V).

    Weights are created directly in their shardings on `mesh` (see `ladder_jax.model.sharding`); the
    same `rngs` seed gives the same global weights on any mesh.
    """

    def __init__(self, config: ModelConfig, *, mesh: Mesh, rngs: nnx.Rngs, fsdp: bool = False):
        specs = WeightSpecs.for_model(config, mesh, fsdp=fsdp)
        if fsdp and config.quantize is not None:
            raise ConfigError(
                f"quantize={config.quantize!r} is for decoding: FSDP (training) keeps float weights"
            )
        self.config = config
        self.mesh = mesh
        D, V, pd = config.d_model, config.vocab_size, config.param_dtype
        self.embed = _weight(rngs, mesh, (V, D), specs.embed_vd, pd, 0.02, specs.fsdp_data)
        self.layers = nnx.List(
            [Layer(config, mesh=mesh, specs=specs, rngs=rngs) for _ in range(config.n_layers)]
        )
        self.final_norm = RMSNorm(D, config.norm_eps, mesh=mesh, specs=specs, param_dtype=pd)
        self.head = (
            None
            if config.tie_embeddings
            else _linear(
                rngs,
                mesh,
                "BTD,DV->BTV",
                (D, V),
                specs.head_dv,
                config,
                0.02,
                specs.fsdp_data,
                flat=False,
            )
        )

    def __repr__(self):
        c = self.config
        ladder = ""
        if c.residual == "ladder" and c.ladder_layers is not None:
            ladder = f", ladder_layers={c.ladder_layers}"
        return (
            f"Transformer({c.n_layers}L d={c.d_model} heads={c.n_heads}/{c.n_kv_heads} "
            f"ff={c.d_ff} vocab={c.vocab_size}, residual={c.residual!r}{ladder}, "
            f"{f'weights {c.quantize}, ' if c.quantize else ''}"
            f"params={c.num_params() / 1e6:.2f}M, mesh=data:{self.mesh.shape[DATA]} x "
            f"tp:{self.mesh.shape[TP]})"
        )

    __str__ = __repr__

    # -- the sharded entry point -----------------------------------------------------------

    def __call__(self, tokens_bt, positions_bt=None):
        """Logits (B, T, V) float32 for int tokens (B, T); positions default to 0..T-1, and
        then attention runs as flash attention (`attend_causal`)."""
        return self._sharded(tokens_bt, positions_bt, None)

    def forward_cached(self, tokens_bt, positions_bt, cache):
        """(logits, cache): the forward of `tokens_bt` at `positions_bt` against a KV cache
        (a list of (k, v) per layer: `ladder_jax.inference.cache.KVCache.layers()`), whose
        updated copy is returned. Row b's tokens are written to cache slots positions[b, 0]
        onwards and see the slots before them. `positions_bt=None`: a prompt from slot 0
        (positions 0..T-1), flash attention over the prompt itself (the prefill)."""
        return self._sharded(tokens_bt, positions_bt, cache)

    def hidden(self, tokens_bt):
        """The final normalized hidden state (B, T, D) in the compute dtype, the LM head's input:
        `hidden(t) @ head_weight()` is `model(t)`. For losses that apply the head themselves
        (`ladder_jax.train.step.chunked_cross_entropy`); not for residual="upper_bound", whose
        ranks' streams differ."""
        if self.config.residual == "upper_bound":
            raise ValueError(
                "upper_bound has no single hidden state (its tp ranks' streams "
                "differ): use model(tokens)"
            )
        return self._sharded(tokens_bt, None, None, head=False)

    def head_weight(self, layout: str = "dv"):
        """The LM head, a global array in the compute dtype, stored as the weights are; float
        weights only. `layout="dv"`: (D, V), `hidden(t) @ head_weight()` is `model(t)`;
        `"vd"`: (V, D). `head_layout()` names the one that needs no transpose (a tied head is
        the (V, D) embedding itself)."""
        if layout not in ("dv", "vd"):
            raise ValueError(f"head_weight: layout={layout!r}, choose 'dv' or 'vd'")
        dtype = self.config.dtype
        if self.head is None:
            w = self.embed[...]
            return (w.T if layout == "dv" else w).astype(dtype)
        if self.head.scale is not None:
            raise ValueError("head_weight: the head is quantized (decoding only)")
        w = self.head.weight[...]
        return (w if layout == "dv" else w.T).astype(dtype)

    def head_layout(self) -> str:
        """The layout (`head_weight`) the head is stored in: "vd" when tied to the embedding,
        else "dv"."""
        return "vd" if self.head is None else "dv"

    def _sharded(self, tokens_bt, positions_bt, cache, head=True):
        tokens_bt = jnp.asarray(tokens_bt)
        if tokens_bt.ndim != 2 or not jnp.issubdtype(tokens_bt.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be integers of shape (batch, length), got "
                f"{tokens_bt.dtype}{list(tokens_bt.shape)}"
            )
        tokens_bt = tokens_bt.astype(jnp.int32)
        sharding.check_batch(tokens_bt.shape[0], self.mesh)
        graphdef, state = nnx.split(self)
        specs = stored_specs(state)  # the weights enter as stored (FSDP: split over data)
        batch, logits = P(DATA, None), P(DATA, None, TP) if head else P(DATA, None, None)

        # the positions travel only if given (None: 0..T-1, flash attention), the cache too
        pos_args = () if positions_bt is None else (jnp.asarray(positions_bt),)
        cache_args = () if cache is None else (cache,)
        cache_specs = tuple(jax.tree.map(lambda _: sharding.CACHE_BKSH, c) for c in cache_args)

        def local(state, tokens_bt, *rest):
            positions_bt = rest[0] if pos_args else None
            logits_btv, cache = nnx.merge(graphdef, state).forward_local(
                tokens_bt, positions_bt, *rest[len(pos_args) :], head=head
            )
            return logits_btv if cache is None else (logits_btv, cache)

        in_specs = (specs, batch) + (batch,) * len(pos_args) + cache_specs
        return sharding.shard(
            local,
            self.mesh,
            in_specs=in_specs,
            out_specs=(logits, *cache_specs) if cache_specs else logits,
        )(state, tokens_bt, *pos_args, *cache_args)

    # -- inside shard_map ------------------------------------------------------------------

    def forward_local(self, tokens_bt, positions_bt, caches=None, head=True):
        """One rank's forward: local batch rows, all of D, its heads / F / V slice. Returns
        (logits, updated caches or None); `head=False`: the head's input (B, T, D) instead."""
        c = self.config
        x_btd = sharding.embed_lookup(self.embed, tokens_bt).astype(jnp.float32)
        x_btd, caches = self.layer_loop(x_btd, positions_bt, caches)
        h_btd = self.final_norm(x_btd).astype(c.dtype)
        if not head:
            return h_btd, caches
        if self.head is None:
            head_dv = sharding.local_vocab_rows(
                sharding.read_weight(self.embed), self.mesh.shape[TP]
            ).T.astype(c.dtype)
        else:
            head_dv = self.head.read(c.dtype)
        with jax.named_scope("head"):
            if c.residual == "upper_bound":  # the stream is tp-varying already
                logits_btv = jnp.einsum(
                    "BTD,DV->BTV", h_btd, head_dv, preferred_element_type=jnp.float32
                )
            else:
                logits_btv = residual.lm_head(h_btd, head_dv)
            if self.head is not None:
                logits_btv = self.head.rescale(logits_btv)
        return logits_btv, caches

    def layer_loop(self, x_btd, positions_bt, caches=None):
        """THE layer loop: the layers wired by the config's residual scheme
        (`ladder_jax.model.residual.run`, every scheme). Returns (x, caches)."""
        return residual.run(
            self.config, self.layers, x_btd, positions_bt, rope_frequencies(self.config), caches
        )


# ---------------------------------------------------------------------------------------------
# Input projections fused for decoding.
#
# Matmuls that read the same input: q, k, v of every attention module and gate, up of every
# MLP (parallel: all five, from its one normalized input). Left as separate weights, XLA:GPU's
# dot merger turns them into one matmul over a *new* buffer, the weights concatenated, on every
# step: at decode batch sizes that copy reads and writes the weights again (predict: parallel
# slower than standard at 70B, tp 8, batch >= 4; standard and ladder copy their q/k/v and
# gate/up the same way). Fusing them once, when a model is set up for decoding, gives that one
# matmul over a weight that is already contiguous (and XLA:CPU two matmuls per layer fewer).
# The weight tree itself is unchanged (every tree loads into every scheme and tp size, HF
# import/export untouched): the fused weights live only in the decoding clone.


def fused_input_columns(config: ModelConfig, tp: int) -> tuple[int, int, int]:
    """Per rank: query heads N/tp, kv heads (K/tp, or 1 when kv heads are replicated) and
    MLP hidden F/tp of a `FusedInput` block, whose width is (N' + 2 K') H + 2 F'."""
    kv = 1 if config.n_kv_heads < tp else config.n_kv_heads // tp
    return config.n_heads // tp, kv, config.d_ff // tp


@functools.lru_cache(maxsize=64)
def _fuser(mesh: Mesh, specs: tuple, kv: tuple, n_kv_heads: int):
    """The jitted concatenation `_fuse` runs, one per layout (compiled once, not per model)."""
    tp = sharding.tp_size(mesh)
    out_spec = P(None, TP)

    def local(*ws):
        D = ws[0].shape[0]
        ws = [
            sharding.local_kv_head(w, n_kv_heads, tp) if is_kv and n_kv_heads < tp else w
            for w, is_kv in zip(ws, kv)
        ]
        return jnp.concatenate([w.reshape(D, -1) for w in ws], axis=1)

    return jax.jit(
        sharding.shard(local, mesh, in_specs=specs, out_specs=out_spec),
        out_shardings=NamedSharding(mesh, out_spec),
    )


def _fuse(model: Transformer, weights, kv: tuple) -> FusedInput:
    """One `FusedInput` of `weights` (each (D, ...) and split over tp on its last-but-one or
    last axis), rank by rank; `kv[i]`: weight i is a k or v weight (replicated kv heads are
    narrowed to the rank's own head). Abstract weights give an abstract fused weight."""
    mesh = model.mesh
    out_spec = P(None, TP)
    fuse = _fuser(mesh, tuple(w.spec for w in weights), kv, model.config.n_kv_heads)
    values = [w.get_value() for w in weights]
    if any(isinstance(v, jax.ShapeDtypeStruct) for v in values):
        fused = jax.eval_shape(fuse, *values)
        fused = jax.ShapeDtypeStruct(
            fused.shape, fused.dtype, sharding=NamedSharding(mesh, out_spec)
        )
    else:
        fused = fuse(*values)
    return FusedInput(fused, spec=out_spec)


def fuse_inputs(model: Transformer, *, in_place: bool = False) -> Transformer:
    """For decoding: a clone of `model` (sharing every other weight) whose matmuls over one
    input run as one, over a `FusedLinear` built here, once and installed with
    `FusesInputs.install_fused`: a parallel layer's q/k/v/gate/up (`fused_in`), every other
    scheme's attention q/k/v (`attn.qkv`) and MLP gate/up (`mlp.gate_up`). The clone drops the
    separate weights. Works on abstract models (`abstract`: weights as ShapeDtypeStructs) too,
    giving abstract fused weights.

    `in_place=True` frees each layer's separate projections (their device buffers) as soon as
    its fused copy is made, so the peak is one layer's copy more than the model: `model` must
    not be used again (its q/k/v/gate/up are deleted; the clone is the model now). What
    `decode` and `serve` do: nothing else holds their model.

    Footguns: the fused weights are a copy. While `model` is alive, the fused projections
    (about 2/3 of a Llama layer) are held twice (unless `in_place`). An int8 model's values
    and their per-channel scales are fused alike (a scale is shaped as its weight with the
    contracted axis of size 1), so its fused matmul is rescaled per fused column."""
    n, kv, f = fused_input_columns(model.config, sharding.tp_size(model.mesh))
    H = model.config.head_dim
    parts = {"q": (n, H), "k": (kv, H), "v": (kv, H), "gate": (f,), "up": (f,)}
    clone = nnx.merge(*nnx.split(model))
    for layer in clone.layers:
        for owner in [layer] if model.config.residual == "parallel" else [layer.attn, layer.mlp]:
            linears = owner.input_linears()
            names = [p.rpartition(".")[2] for p in owner.INPUTS]
            kv_parts = tuple(name in ("k", "v") for name in names)
            weight = _fuse(model, [lin.weight for lin in linears], kv_parts)
            scale = (
                None
                if linears[0].scale is None
                else _fuse(model, [lin.scale for lin in linears], kv_parts)
            )
            if in_place:
                jax.block_until_ready(weight.get_value())
                for lin in linears:
                    for v in (lin.weight, lin.scale):
                        if v is not None and isinstance(v.get_value(), jax.Array):
                            v.get_value().delete()
            fused = FusedLinear(
                weight,
                tuple(parts[name] for name in names),
                matmul=linear_matmul(model.mesh, model.config),
            )
            if scale is not None:
                fused.scale = nnx.data(scale)
            owner.install_fused(fused)
    return clone


def param_specs(state: nnx.State) -> nnx.State:
    """The partition spec of every weight in `state` (a tree of the same structure): how the
    model reads it, split over tp."""
    return jax.tree.map(lambda v: v.spec, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def stored_specs(state: nnx.State) -> nnx.State:
    """Where every weight in `state` is stored: its tp spec, and under FSDP also split over
    data (`Transformer(..., fsdp=True)`, `WeightSpecs.fsdp`)."""
    return jax.tree.map(
        lambda v: getattr(v, "stored", None) or v.spec,
        state,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )


def abstract(config: ModelConfig, mesh: Mesh, *, fsdp: bool = False):
    """The model from shapes alone: (graphdef, state) where every weight is a
    `jax.ShapeDtypeStruct` carrying its (stored) `NamedSharding` on `mesh`; nothing is
    allocated. Load or restore weights into that state, then `nnx.merge(graphdef, state)`.
    Raises ShardingError if `config` cannot be split over the mesh."""
    model = nnx.eval_shape(lambda: Transformer(config, mesh=mesh, rngs=nnx.Rngs(0), fsdp=fsdp))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(
        lambda v: v.replace(
            jax.ShapeDtypeStruct(
                v.shape, v.dtype, sharding=NamedSharding(mesh, getattr(v, "stored", None) or v.spec)
            )
        ),
        state,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    return graphdef, state


def with_config(model: Transformer, **changes) -> Transformer:
    """The same weights (shared, not copied) under a changed config, e.g. another residual
    scheme: `with_config(model, residual="ladder", ladder_layers=2)`. The mesh stays. A scheme
    other than ladder drops the model's ladder_layers (`with_config(hybrid, residual=
    "standard")`), unless ladder_layers is given too."""
    if changes.get("residual", "ladder") != "ladder":
        changes = {"ladder_layers": None, **changes}
    config = dataclasses.replace(model.config, **changes)
    WeightSpecs.for_model(config, model.mesh)
    graphdef, state = nnx.split(model)
    clone = nnx.merge(graphdef, state)
    clone.config = config
    if config.decode_matmul != model.config.decode_matmul:
        for node in quant.linears(clone):
            node.matmul = linear_matmul(model.mesh, config)
    return clone
