"""The Ladder Transformer: a Llama-style decoder with four residual schemes, in Flax NNX.

Dimension letters, used in every einsum and name of the package:
    B batch, T query length, S key/cache length, D model width, F MLP hidden, N query heads,
    K kv heads, G = N/K query heads per kv head, H head dim, V vocabulary, L layers.

Architecture: token embedding (V, D) -> L layers -> RMSNorm -> LM head (D, V), tied to the
embedding or not. Each layer has two *modules*: attention A (grouped-query, causal, RoPE with
optional llama-3 frequency scaling, weights q (D,N,H), k/v (D,K,H), o (N,H,D)) and a SwiGLU MLP
M (gate/up (D,F), down (F,D)), each behind its own RMSNorm. No biases.

Under tensor parallelism every module ends in a row-parallel matmul, so its output is a partial
sum that must be all-reduced (`psum`) over `tp` before it is added to the residual stream x.
The residual scheme decides *what each module reads*:

    standard     x = x + psum(A(norm(x)));  x = x + psum(M(norm(x)))     2 blocking psums/layer
    parallel     h = norm(x);  x = x + psum(A(h) + M(h))                   1 psum/layer; uses
                                                                          attn_norm only
    ladder       each module reads the stream *without* the previous module's output, whose
                 psum is still in flight; it is added just before the module after next reads:
                     x = x + pending_A;  a = A(norm(x));  pending_A = psum(a)
                     x = x + pending_M;  m = M(norm(x));  pending_M = psum(m)
                 and after the last layer x = x + pending_A + pending_M. The psum of module i
                 overlaps module i+1's matmuls. The stream still accumulates every output.
    upper_bound  standard wiring with every psum dropped: ranks' streams diverge. NOT a valid
                 model, a speed ceiling for benchmarks only (equals standard at tp=1).

Hybrid ladder (`residual="ladder"`, `ladder_layers=N` or a list of layer indices): only those
layers are ladder layers, the others standard. The rule that covers every case, boundaries
included: before a module of a ladder layer reads x, every pending output but the most recent
one is added; before a module of a standard layer reads, all are added. So the first ladder
layer's attention reads the stream without the previous standard layer's MLP output.
`ladder_layers=0` runs exactly the standard program, bit for bit.

All schemes share one weight tree, so any weights load into any scheme and any tp size.

Training: for ladder layers the backward pass is hand-written (`_ladder_stream`) so that it is
a ladder too: the all-reduce of module i's input cotangent overlaps module i-1's backward
matmuls. Autodiff's reverse-order program would block on every one. Same maths, tested
against autodiff of an independent reference.

Footguns:
- `Transformer.__call__` runs through one `shard_map` over the model's mesh; calling it under
  `nnx.jit` compiles one program. On GPUs compile with `ladder_jax.sharding.jit` (or use the
  package's entry points): it adds the XLA options the ladder's overlap needs.
- Logits come back float32 and sharded over V on `tp`; reductions over V under jit are fine.
- Parameters are float32 by default (`param_dtype`); matmuls run in `dtype`; norms, softmax
  and logits in float32.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ladder_jax import sharding
from ladder_jax.sharding import DATA, TP, WeightSpecs

RESIDUALS = ("standard", "parallel", "ladder", "upper_bound")


class ConfigError(ValueError):
    """A configuration that cannot be built; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """llama-3 style RoPE frequency scaling (long wavelengths slowed by `factor`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    head_dim: int | None = None  # default d_model // n_heads
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    residual: str = "standard"
    ladder_layers: int | tuple[int, ...] | None = None  # ladder only: None = all layers
    dtype: str = "float32"  # matmul compute dtype
    param_dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: "
                    f"set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.residual not in RESIDUALS:
            close = difflib.get_close_matches(str(self.residual), RESIDUALS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown residual scheme {self.residual!r}{hint}: choose one of "
                f"{', '.join(RESIDUALS)}")
        for name in ("dtype", "param_dtype"):
            try:
                jnp.dtype(getattr(self, name))
            except TypeError:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not a dtype name") from None
        ll = self.ladder_layers
        if ll is None:
            return
        if self.residual != "ladder":
            raise ConfigError(
                f"ladder_layers={ll!r} is set but residual={self.residual!r}: ladder_layers "
                f"only applies to residual='ladder'")
        if isinstance(ll, bool):
            raise ConfigError(f"ladder_layers={ll!r} must be an int or a list of layer indices")
        if isinstance(ll, int):
            if not 0 <= ll <= self.n_layers:
                raise ConfigError(
                    f"ladder_layers={ll} must be between 0 and n_layers={self.n_layers}")
            return
        idx = tuple(ll)
        bad = [i for i in idx if not isinstance(i, int) or not 0 <= i < self.n_layers]
        if bad or len(set(idx)) != len(idx):
            raise ConfigError(
                f"ladder_layers={list(idx)} must be distinct layer indices in "
                f"[0, {self.n_layers})")
        object.__setattr__(self, "ladder_layers", tuple(sorted(idx)))

    # -- presets ---------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named preset (see `PRESETS`), with any field overridden by keyword."""
        if name not in PRESETS:
            close = difflib.get_close_matches(name, PRESETS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown preset {name!r}{hint}: choose one of {', '.join(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in overrides:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"unknown ModelConfig field {key!r}{hint}")
        return cls(**{**PRESETS[name], **overrides})

    # -- derived ---------------------------------------------------------------------------

    def ladder_layer_set(self) -> frozenset[int]:
        """Indices of the layers with ladder wiring (empty unless residual == 'ladder')."""
        if self.residual != "ladder":
            return frozenset()
        ll = self.ladder_layers
        if ll is None:
            return frozenset(range(self.n_layers))
        if isinstance(ll, int):
            return frozenset(range(self.n_layers - ll, self.n_layers))
        return frozenset(ll)

    def num_params(self) -> int:
        D, F, V, H = self.d_model, self.d_ff, self.vocab_size, self.head_dim
        attn = D * self.n_heads * H * 2 + D * self.n_kv_heads * H * 2
        layer = attn + 3 * D * F + 2 * D
        embed = V * D * (1 if self.tie_embeddings else 2)
        return self.n_layers * layer + embed + D


PRESETS: dict[str, dict] = {  # ModelConfig fields; head_dim is derived unless given
    # CPU-sized, byte-level vocabulary (256 bytes + specials, padded to a multiple of 16).
    "tiny": dict(vocab_size=320, d_model=64, n_layers=4, n_heads=8, n_kv_heads=4,
                        d_ff=128, max_seq_len=256),
    "small": dict(vocab_size=320, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4,
                         d_ff=768, max_seq_len=512),
    # The paper's inference-benchmark shapes (ICML 2025, arXiv 2501.06589).
    "1b": dict(vocab_size=49152, d_model=1536, n_layers=40, n_heads=24, n_kv_heads=24,
                      d_ff=4096, dtype="bfloat16", param_dtype="bfloat16"),
    "3b": dict(vocab_size=49152, d_model=2304, n_layers=40, n_heads=32, n_kv_heads=32,
                      d_ff=9216, dtype="bfloat16", param_dtype="bfloat16"),
    "llama-3-8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                              n_kv_heads=8, d_ff=14336, max_seq_len=8192, rope_theta=500000.0,
                              dtype="bfloat16", param_dtype="bfloat16"),
    "34b": dict(vocab_size=32000, d_model=8192, n_layers=48, n_heads=64, n_kv_heads=8,
                       d_ff=22016, max_seq_len=16384, rope_theta=1000000.0,
                       dtype="bfloat16", param_dtype="bfloat16"),
    "llama-3-70b": dict(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                               n_kv_heads=8, d_ff=28672, max_seq_len=8192,
                               rope_theta=500000.0, dtype="bfloat16", param_dtype="bfloat16"),
    "llama-3.1-405b": dict(vocab_size=128256, d_model=16384, n_layers=126, n_heads=128,
                                  n_kv_heads=16, d_ff=53248, max_seq_len=131072,
                                  rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0),
                                  dtype="bfloat16", param_dtype="bfloat16"),
}


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


def _weight(rngs: nnx.Rngs, mesh: Mesh, shape, spec: P, dtype, std: float) -> nnx.Param:
    assert jax.config.jax_threefry_partitionable, "mesh-independent init needs it"
    value = _normal(rngs.params(), shape=tuple(shape), dtype=jnp.dtype(dtype), std=std,
                    sharding=NamedSharding(mesh, spec))
    return nnx.Param(value, spec=spec)


# ---------------------------------------------------------------------------------------------
# Modules. Their __call__s run *inside* shard_map, on each rank's local shard of the weights.


class RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float, *, mesh: Mesh, specs: WeightSpecs, param_dtype):
        self.eps = eps
        self.scale = nnx.Param(_ones(shape=(d,), dtype=jnp.dtype(param_dtype),
                                     sharding=NamedSharding(mesh, specs.norm_d)),
                               spec=specs.norm_d)

    def __call__(self, x_btd):
        x = x_btd.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return x * self.scale[...].astype(jnp.float32)


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
        sc.high_freq_factor - sc.low_freq_factor)
    mid = (1 - smooth) * inv / sc.factor + smooth * inv
    return jnp.where(wavelen > low_wavelen, inv / sc.factor,
                     jnp.where(wavelen < high_wavelen, inv, mid))


def apply_rope(x_btnh, positions_bt, inv_freq):
    """Rotate the two halves of each head (the Llama / Hugging Face layout)."""
    angles = positions_bt[:, :, None].astype(jnp.float32) * inv_freq  # B T H/2
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_btnh.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, mesh: Mesh, specs: WeightSpecs, rngs: nnx.Rngs):
        D, N, K, H = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        pd = config.param_dtype
        std_out = 0.02 / math.sqrt(2 * config.n_layers)
        self.q = _weight(rngs, mesh, (D, N, H), specs.q_dnh, pd, 0.02)
        self.k = _weight(rngs, mesh, (D, K, H), specs.kv_dkh, pd, 0.02)
        self.v = _weight(rngs, mesh, (D, K, H), specs.kv_dkh, pd, 0.02)
        self.o = _weight(rngs, mesh, (N, H, D), specs.o_nhd, pd, std_out)
        self.n_kv_heads = K
        self.tp = sharding.tp_size(mesh)
        self.kv_replicated = specs.kv_replicated
        self.dtype = config.dtype

    def __call__(self, x_btd, positions_bt, inv_freq, cache=None):
        """This rank's partial sum (B, T, D) of the attention output; with a KV cache
        (k, v), each (B, S, K_local, H), also the cache with this call's keys and values
        written at `positions_bt` (row b's tokens go to slots positions[b, 0] onwards)."""
        dt = self.dtype
        x = x_btd.astype(dt)
        wk, wv = self.k[...], self.v[...]
        if self.kv_replicated:
            wk = sharding.local_kv_head(wk, self.n_kv_heads, self.tp)
            wv = sharding.local_kv_head(wv, self.n_kv_heads, self.tp)
        q_btnh = jnp.einsum("BTD,DNH->BTNH", x, self.q[...].astype(dt))
        k_btkh = jnp.einsum("BTD,DKH->BTKH", x, wk.astype(dt))
        v_btkh = jnp.einsum("BTD,DKH->BTKH", x, wv.astype(dt))
        q_btnh = apply_rope(q_btnh, positions_bt, inv_freq)
        k_btkh = apply_rope(k_btkh, positions_bt, inv_freq)
        if cache is None:
            out_btnh = attend(q_btnh, k_btkh, v_btkh, positions_bt, positions_bt)
        else:
            k_bskh, v_bskh = (write_cache(c, new, positions_bt[:, 0])
                              for c, new in zip(cache, (k_btkh, v_btkh)))
            B, S = k_bskh.shape[:2]
            slots_bs = jnp.broadcast_to(jnp.arange(S, dtype=positions_bt.dtype), (B, S))
            out_btnh = attend(q_btnh, k_bskh, v_bskh, positions_bt, slots_bs)
            cache = (k_bskh, v_bskh)
        y_btd = jnp.einsum("BTNH,NHD->BTD", out_btnh, self.o[...].astype(dt))
        return y_btd if cache is None else (y_btd, cache)


def write_cache(cache_bskh, new_btkh, start_b):
    """Writes row b's T new entries at slots start[b]... in place (under donation). Like every
    dynamic update in XLA it clamps out-of-range starts: callers check lengths on the host."""
    def row(c_skh, n_tkh, start):
        return jax.lax.dynamic_update_slice_in_dim(c_skh, n_tkh.astype(c_skh.dtype), start, 0)
    return jax.vmap(row)(cache_bskh, new_btkh, start_b)


def attend(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs):
    """Causal grouped-query attention: query t sees key s iff k_pos[s] <= q_pos[t]."""
    B, T, N, H = q_btnh.shape
    K = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(B, T, K, N // K, H)
    scores_bkgts = jnp.einsum("BTKGH,BSKH->BKGTS", q_btkgh, k_bskh,
                              preferred_element_type=jnp.float32) / math.sqrt(H)
    visible_bts = k_pos_bs[:, None, :] <= q_pos_bt[:, :, None]
    scores_bkgts = jnp.where(visible_bts[:, None, None], scores_bkgts, -1e30)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(v_bskh.dtype)
    out_btkgh = jnp.einsum("BKGTS,BSKH->BTKGH", probs_bkgts, v_bskh)
    return out_btkgh.reshape(B, T, N, H)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, mesh: Mesh, specs: WeightSpecs, rngs: nnx.Rngs):
        D, F, pd = config.d_model, config.d_ff, config.param_dtype
        self.gate = _weight(rngs, mesh, (D, F), specs.up_df, pd, 0.02)
        self.up = _weight(rngs, mesh, (D, F), specs.up_df, pd, 0.02)
        self.down = _weight(rngs, mesh, (F, D), specs.down_fd, pd,
                            0.02 / math.sqrt(2 * config.n_layers))
        self.dtype = config.dtype

    def __call__(self, x_btd):
        """Returns this rank's partial sum (B, T, D) of the SwiGLU output."""
        dt = self.dtype
        x = x_btd.astype(dt)
        g_btf = jnp.einsum("BTD,DF->BTF", x, self.gate[...].astype(dt))
        u_btf = jnp.einsum("BTD,DF->BTF", x, self.up[...].astype(dt))
        return jnp.einsum("BTF,FD->BTD", jax.nn.silu(g_btf) * u_btf, self.down[...].astype(dt))


class Layer(nnx.Module):
    def __init__(self, config: ModelConfig, *, mesh: Mesh, specs: WeightSpecs, rngs: nnx.Rngs):
        kw = dict(mesh=mesh, specs=specs, param_dtype=config.param_dtype)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.attn = Attention(config, mesh=mesh, specs=specs, rngs=rngs)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.mlp = MLP(config, mesh=mesh, specs=specs, rngs=rngs)


class Transformer(nnx.Module):
    """The decoder. `model(tokens)` maps int32 tokens (B, T) to float32 logits (B, T, V).

    Weights are created directly in their shardings on `mesh` (see `ladder_jax.sharding`); the
    same `rngs` seed gives the same global weights on any mesh.
    """

    def __init__(self, config: ModelConfig, *, mesh: Mesh, rngs: nnx.Rngs):
        specs = WeightSpecs.for_model(config, mesh)
        self.config = config
        self.mesh = mesh
        D, V, pd = config.d_model, config.vocab_size, config.param_dtype
        self.embed = _weight(rngs, mesh, (V, D), specs.embed_vd, pd, 0.02)
        self.layers = nnx.List(
            [Layer(config, mesh=mesh, specs=specs, rngs=rngs) for _ in range(config.n_layers)])
        self.final_norm = RMSNorm(D, config.norm_eps, mesh=mesh, specs=specs, param_dtype=pd)
        self.head = None if config.tie_embeddings else _weight(
            rngs, mesh, (D, V), specs.head_dv, pd, 0.02)

    def __repr__(self):
        c = self.config
        ladder = ""
        if c.residual == "ladder" and c.ladder_layers is not None:
            ladder = f", ladder_layers={c.ladder_layers}"
        return (f"Transformer({c.n_layers}L d={c.d_model} heads={c.n_heads}/{c.n_kv_heads} "
                f"ff={c.d_ff} vocab={c.vocab_size}, residual={c.residual!r}{ladder}, "
                f"params={c.num_params() / 1e6:.2f}M, mesh=data:{self.mesh.shape[DATA]} x "
                f"tp:{self.mesh.shape[TP]})")

    __str__ = __repr__

    # -- the sharded entry point -----------------------------------------------------------

    def __call__(self, tokens_bt, positions_bt=None):
        """Logits (B, T, V) float32 for int tokens (B, T); positions default to 0..T-1."""
        return self._sharded(tokens_bt, positions_bt, None)

    def forward_cached(self, tokens_bt, positions_bt, cache):
        """(logits, cache): the forward of `tokens_bt` at `positions_bt` against a KV cache
        (see `ladder_jax.decode.init_cache`), whose updated copy is returned. Row b's tokens
        are written to cache slots positions[b, 0] onwards and see the slots before them."""
        return self._sharded(tokens_bt, positions_bt, cache)

    def _sharded(self, tokens_bt, positions_bt, cache):
        tokens_bt = jnp.asarray(tokens_bt)
        if tokens_bt.ndim != 2 or not jnp.issubdtype(tokens_bt.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be integers of shape (batch, length), got "
                f"{tokens_bt.dtype}{list(tokens_bt.shape)}")
        tokens_bt = tokens_bt.astype(jnp.int32)
        sharding.check_batch(tokens_bt.shape[0], self.mesh)
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32),
                                            tokens_bt.shape)
        graphdef, state = nnx.split(self)
        specs = param_specs(state)
        batch, logits = P(DATA, None), P(DATA, None, TP)

        cache_args = () if cache is None else (cache,)  # the cache travels only if given
        cache_specs = tuple(jax.tree.map(lambda _: sharding.CACHE_BSKH, c) for c in cache_args)

        def local(state, tokens_bt, positions_bt, *cache):
            return nnx.merge(graphdef, state).forward_local(tokens_bt, positions_bt, *cache)

        return sharding.shard(local, self.mesh, in_specs=(specs, batch, batch, *cache_specs),
                              out_specs=(logits, *cache_specs) if cache_specs else logits)(
            state, tokens_bt, positions_bt, *cache_args)

    # -- inside shard_map ------------------------------------------------------------------

    def forward_local(self, tokens_bt, positions_bt, caches=None):
        """One rank's forward: local batch rows, all of D, its heads / F / V slice."""
        c = self.config
        tp = self.mesh.shape[TP]
        x_btd = jnp.take(self.embed[...], tokens_bt, axis=0).astype(jnp.float32)
        x_btd = self.residual_stream(x_btd, positions_bt, caches)
        if caches is not None:
            x_btd, caches = x_btd
        h_btd = self.final_norm(x_btd).astype(c.dtype)
        if self.head is None:
            head_dv = sharding.local_vocab_rows(self.embed[...], tp).T
        else:
            head_dv = self.head[...]
        head_dv = head_dv.astype(c.dtype)
        with jax.named_scope("head"):
            if c.residual == "upper_bound":  # the stream is tp-varying already
                logits_btv = jnp.einsum("BTD,DV->BTV", h_btd, head_dv,
                                        preferred_element_type=jnp.float32)
            else:
                logits_btv = _lm_head(h_btd, head_dv)
        return logits_btv if caches is None else (logits_btv, caches)

    def residual_stream(self, x_btd, positions_bt, caches=None):
        """The layers. Parallel is spelled out here; the others run `_stream`. With `caches`
        (one (k, v) per layer) returns (x, updated caches)."""
        c = self.config
        inv_freq = rope_frequencies(c)
        if c.residual == "parallel":
            new_caches = []
            for i, layer in enumerate(self.layers):
                with jax.named_scope(f"layer{i}.parallel"):
                    h_btd = layer.attn_norm(x_btd).astype(c.dtype)
                    a_btd = layer.attn(h_btd, positions_bt, inv_freq,
                                       None if caches is None else caches[i])
                    if caches is not None:
                        a_btd, cache = a_btd
                        new_caches.append(cache)
                    x_btd = x_btd + sharding.reduce_tp(a_btd + layer.mlp(h_btd))
            return x_btd if caches is None else (x_btd, new_caches)
        parts, static = [], []
        for i, layer in enumerate(self.layers):
            for name, norm, module in (("attn", layer.attn_norm, layer.attn),
                                       ("mlp", layer.mlp_norm, layer.mlp)):
                (gn, sn), (gm, sm) = nnx.split(norm), nnx.split(module)
                parts.append((sn, sm))
                static.append((i, name, gn, gm))
        plan = (c, tuple(static))
        if caches is None and c.ladder_layer_set():
            return _ladder_stream(plan, parts, x_btd, positions_bt)
        return _stream(plan, parts, x_btd, positions_bt, caches=caches)


@jax.custom_vjp
def _lm_head(h_btd, head_dv):
    """Vocab-parallel logits (B, T, V/tp) in float32. The backward issues the all-reduce of the
    input cotangent, then computes the head's weight gradient while it is in flight."""
    return jnp.einsum("BTD,DV->BTV", jax.lax.pcast(h_btd, TP, to="varying"), head_dv,
                      preferred_element_type=jnp.float32)


def _lm_head_fwd(h_btd, head_dv):
    return _lm_head(h_btd, head_dv), (h_btd, head_dv)


def _lm_head_bwd(res, ct_btv):
    h_btd, head_dv = res
    ct_btv = ct_btv.astype(head_dv.dtype)
    ct_h_btd = sharding.reduce_tp(jnp.einsum("BTV,DV->BTD", ct_btv, head_dv))
    ct_head_dv = jnp.einsum("BTD,BTV->DV", jax.lax.pcast(h_btd, TP, to="varying"), ct_btv)
    ct_head_dv = jax.lax.psum(ct_head_dv, DATA)  # data-parallel gradient sum
    ct_h_btd, ct_head_dv = sharding.tie(ct_h_btd, ct_head_dv)
    return ct_h_btd, ct_head_dv


_lm_head.defvjp(_lm_head_fwd, _lm_head_bwd)


# ---------------------------------------------------------------------------------------------
# THE layer loop (standard, ladder, hybrid, upper_bound), and the ladder's backward pass.
#
# A "plan" is (config, ((layer, "attn"|"mlp", norm graphdef, module graphdef), ...)) and
# `parts` the matching ((norm state, module state), ...): the 2L modules in order.


def _call(plan, k, positions_bt):
    """Module k's two functions: norm (state, x) -> h and module (state, h) -> partial sum.
    The module's input is cast to tp-varying by the caller: in the backward that cast is the
    all-reduce of the input cotangent, which `_ladder_bwd` issues itself."""
    c, static = plan
    _, name, gn, gm = static[k]
    inv_freq = rope_frequencies(c)

    def norm(state, x_btd):
        return nnx.merge(gn, state)(x_btd).astype(c.dtype)

    def module(state, h_btd, cache=None):  # h_btd: tp-varying (see `_stream`)
        m = nnx.merge(gm, state)
        return m(h_btd, positions_bt, inv_freq, cache) if name == "attn" else m(h_btd)

    return norm, module


def _stream(plan, parts, x_btd, positions_bt, vjps=None, caches=None):
    """Runs the modules in order. A standard module reads the stream with every output added;
    a ladder module all but the newest, whose all-reduce stays in flight while it computes
    and is added right after (tied to its output, see `sharding.tie`). With `vjps` (a list),
    records each module's (norm vjp, module vjp) for `_ladder_stream`'s backward. With
    `caches` (a (k, v) per layer) the attention modules read and write them, and the result is
    (x, updated caches)."""
    c, static = plan
    ladder = c.ladder_layer_set()
    caches = None if caches is None else list(caches)
    if c.residual == "upper_bound":  # no all-reduce: the stream itself becomes tp-varying
        reduce = vary = lambda y: y
    else:
        reduce, vary = sharding.reduce_tp, lambda h: jax.lax.pcast(h, TP, to="varying")
    pending = []  # all-reduced module outputs not yet added to x, oldest first
    for k, (i, name, _, _) in enumerate(static):
        with jax.named_scope(f"layer{i}.{name}"):  # names the ops in the compiled HLO
            while len(pending) > (1 if i in ladder else 0):
                x_btd = x_btd + pending.pop(0)
            norm, module = _call(plan, k, positions_bt)
            (norm_state, module_state) = parts[k]
            if caches is not None and name == "attn":
                h_btd = vary(norm(norm_state, x_btd))
                y_btd, caches[i] = module(module_state, h_btd, caches[i])
            elif vjps is None:
                h_btd = vary(norm(norm_state, x_btd))
                y_btd = module(module_state, h_btd)
            else:
                h_btd, norm_vjp = jax.vjp(norm, norm_state, x_btd)
                h_btd = vary(h_btd)
                y_btd, module_vjp = jax.vjp(module, module_state, h_btd)
                vjps.append((norm_vjp, module_vjp))
            if pending:  # ladder: that all-reduce was in flight while `module` ran
                p_btd, y_btd = sharding.tie(pending.pop(), y_btd)
                x_btd = x_btd + p_btd
            pending.append(reduce(y_btd))
    for p_btd in pending:
        x_btd = x_btd + p_btd
    return x_btd if caches is None else (x_btd, caches)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ladder_stream(plan, parts, x_btd, positions_bt):
    """`_stream` with a hand-written backward pass that is a ladder too.

    Autodiff would transpose the forward in reverse program order, and there the all-reduce
    of module k's input cotangent is consumed (by its norm's backward) right after it is
    issued: every backward all-reduce blocks. But nothing of module k-1's backward needs it:
    module k read the stream *before* module k-1's output was added. So here, for a ladder
    module k, the input-cotangent all-reduce is issued, module k-1's backward matmuls run,
    and only then is the result tied in and pushed through module k's norm. Same maths as
    autodiff (tested against it), different schedule.
    """
    return _stream(plan, parts, x_btd, positions_bt)


def _ladder_fwd(plan, parts, x_btd, positions_bt):
    vjps = []
    return _stream(plan, parts, x_btd, positions_bt, vjps), vjps


def _ladder_bwd(plan, vjps, ct_x_btd):
    c, static = plan
    ladder = c.ladder_layer_set()
    n = len(static)
    # Which all-reduced outputs were added to the stream where (the forward's bookkeeping):
    # module k>0 either flushed module k-1's output before reading (standard) or added it
    # right after computing (ladder); the last module's output is added at the end.
    ct_p = {n - 1: ct_x_btd}  # cotangent of each all-reduced module output
    ct_parts = [None] * n
    in_flight = None  # (k, all-reduced input cotangent of module k), not yet consumed

    def consume(k, ct_h_btd, ct_x_btd):
        ct_norm_state, ct_x_add = vjps[k][0](ct_h_btd)
        ct_parts[k] = (ct_norm_state, ct_parts[k])
        return ct_x_btd + ct_x_add

    for k in reversed(range(n)):
        i, name = static[k][:2]
        with jax.named_scope(f"layer{i}.{name}"):
            ct_y_btd = ct_p.pop(k).astype(c.dtype)  # the module's output dtype
            ct_y_btd = jax.lax.pcast(ct_y_btd, TP, to="varying")  # psum's transpose
            ct_module_state, ct_h_btd = vjps[k][1](ct_y_btd)  # module k's backward matmuls
            ct_parts[k] = ct_module_state
            if in_flight is not None:  # module k+1's all-reduce ran during those matmuls
                j, ct_in_flight = in_flight
                ct_in_flight, ct_h_btd = sharding.tie(ct_in_flight, ct_h_btd)
                ct_x_btd = consume(j, ct_in_flight, ct_x_btd)
                in_flight = None
            if k > 0 and i in ladder:  # module k-1's output was added after module k read
                ct_p[k - 1] = ct_x_btd
            ct_h_btd = sharding.reduce_tp(ct_h_btd)  # all-reduce of module k's input cotangent
            if k > 0 and i in ladder:
                in_flight = (k, ct_h_btd)  # nothing before module k-1's backward needs it
            else:
                ct_x_btd = consume(k, ct_h_btd, ct_x_btd)
                if k > 0:  # module k-1's output was added before module k read
                    ct_p[k - 1] = ct_x_btd
    if in_flight is not None:
        ct_x_btd = consume(*in_flight, ct_x_btd)
    ct_parts = [(norm_ct, module_ct) for norm_ct, module_ct in ct_parts]
    return ct_parts, ct_x_btd, None


_ladder_stream.defvjp(_ladder_fwd, _ladder_bwd)


def param_specs(state: nnx.State) -> nnx.State:
    """The partition spec of every weight in `state` (a tree of the same structure)."""
    return jax.tree.map(lambda v: v.spec, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def param_shardings(model: Transformer):
    return jax.tree.map(lambda s: NamedSharding(model.mesh, s), param_specs(nnx.state(model)),
                        is_leaf=lambda s: isinstance(s, P))


def with_config(model: Transformer, **changes) -> Transformer:
    """The same weights (shared, not copied) under a changed config, e.g. another residual
    scheme: `with_config(model, residual="ladder", ladder_layers=2)`. The mesh stays."""
    config = dataclasses.replace(model.config, **changes)
    WeightSpecs.for_model(config, model.mesh)
    graphdef, state = nnx.split(model)
    clone = nnx.merge(graphdef, state)
    clone.config = config
    return clone
