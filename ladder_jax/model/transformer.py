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
layers are ladder layers, the others standard. The one rule that covers every case, boundaries
included, is the wiring of `ladder_jax.model.residual`: a module of a ladder layer (but the very
first module) reads the stream before the previous module's output is added; a module of a
standard layer reads it after. So the first ladder layer's attention reads the stream without
the previous standard layer's MLP output. `ladder_layers=0` runs exactly the standard
program, bit for bit.

All schemes share one weight tree, so any weights load into any scheme and any tp size.

Training: for ladder layers the backward pass is hand-written (`ladder_jax.model.residual`) so that
it is a ladder too: the all-reduce of module i's input cotangent overlaps module i-1's backward
matmuls. Autodiff's reverse-order program would block on every one. Same maths, tested
against autodiff of an independent reference.

Footguns:
- `Transformer.__call__` runs through one `shard_map` over the model's mesh; calling it under
  `nnx.jit` compiles one program. On GPUs compile with `ladder_jax.model.sharding.jit` (or use the
  package's entry points): it adds the XLA options the ladder's overlap needs.
- Logits come back float32 and sharded over V on `tp`; reductions over V under jit are fine.
- Parameters are float32 by default (`param_dtype`); matmuls run in `dtype`; norms, softmax
  and logits in float32.
- `config.quantize="int8"`: every linear weight is int8 values plus a float32 scale per
  output channel (attribute `<name>_scale`, None for float weights), read through
  `ladder_jax.model.quant.einsum`; for decoding only (`ladder_jax.model.quant`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ladder_jax.config import PRESETS, RESIDUALS, ConfigError, ModelConfig, RopeScaling  # noqa: F401
from ladder_jax.model import quant, residual, sharding
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


def _weight(rngs: nnx.Rngs, mesh: Mesh, shape, spec: P, dtype, std: float,
            fsdp_data: int = 1) -> nnx.Param:
    """A weight drawn in place: `spec` is its tp layout (how the model reads it), `stored` where
    it lives, split over `data` too under FSDP (`WeightSpecs.fsdp`; read with
    `sharding.read_weight`)."""
    assert jax.config.jax_threefry_partitionable, "mesh-independent init needs it"
    stored = WeightSpecs.fsdp(spec, shape, fsdp_data)
    value = _normal(rngs.params(), shape=tuple(shape), dtype=jnp.dtype(dtype), std=std,
                    sharding=NamedSharding(mesh, stored))
    return nnx.Param(value, spec=spec, stored=stored)


def _linear(rngs: nnx.Rngs, mesh: Mesh, name: str, shape, spec: P, config: ModelConfig,
            std: float, fsdp_data: int = 1) -> tuple[nnx.Param, nnx.Param | None]:
    """A linear weight `name` and its scale: None for float weights; with `config.quantize`
    the same draw, quantized in place (`ladder_jax.model.quant`)."""
    w = _weight(rngs, mesh, shape, spec, config.param_dtype, std, fsdp_data)
    return (w, None) if config.quantize is None else quant.quantized_param(w, name, mesh)


# ---------------------------------------------------------------------------------------------
# Modules. Their __call__s run *inside* shard_map, on each rank's local shard of the weights.


class RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float, *, mesh: Mesh, specs: WeightSpecs, param_dtype):
        self.eps = eps
        stored = WeightSpecs.fsdp(specs.norm_d, (d,), specs.fsdp_data)
        self.scale = nnx.Param(_ones(shape=(d,), dtype=jnp.dtype(param_dtype),
                                     sharding=NamedSharding(mesh, stored)),
                               spec=specs.norm_d, stored=stored)

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
        std_out = 0.02 / math.sqrt(2 * config.n_layers)
        fs = specs.fsdp_data
        self.q, self.q_scale = _linear(rngs, mesh, "q", (D, N, H), specs.q_dnh, config, 0.02, fs)
        self.k, self.k_scale = _linear(rngs, mesh, "k", (D, K, H), specs.kv_dkh, config, 0.02, fs)
        self.v, self.v_scale = _linear(rngs, mesh, "v", (D, K, H), specs.kv_dkh, config, 0.02, fs)
        self.o, self.o_scale = _linear(rngs, mesh, "o", (N, H, D), specs.o_nhd, config, std_out,
                                       fs)
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
        pick = functools.partial(sharding.local_kv_head, n_kv_heads=self.n_kv_heads,
                                 tp=self.tp) if self.kv_replicated else None
        q_btnh = quant.einsum("BTD,DNH->BTNH", x, self.q, self.q_scale, dt)
        k_btkh = quant.einsum("BTD,DKH->BTKH", x, self.k, self.k_scale, dt, pick)
        v_btkh = quant.einsum("BTD,DKH->BTKH", x, self.v, self.v_scale, dt, pick)
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
        y_btd = quant.einsum("BTNH,NHD->BTD", out_btnh, self.o, self.o_scale, dt)
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
        D, F = config.d_model, config.d_ff
        fs = specs.fsdp_data
        self.gate, self.gate_scale = _linear(rngs, mesh, "gate", (D, F), specs.up_df, config,
                                             0.02, fs)
        self.up, self.up_scale = _linear(rngs, mesh, "up", (D, F), specs.up_df, config, 0.02, fs)
        self.down, self.down_scale = _linear(rngs, mesh, "down", (F, D), specs.down_fd, config,
                                             0.02 / math.sqrt(2 * config.n_layers), fs)
        self.dtype = config.dtype

    def __call__(self, x_btd):
        """Returns this rank's partial sum (B, T, D) of the SwiGLU output."""
        dt = self.dtype
        x = x_btd.astype(dt)
        g_btf = quant.einsum("BTD,DF->BTF", x, self.gate, self.gate_scale, dt)
        u_btf = quant.einsum("BTD,DF->BTF", x, self.up, self.up_scale, dt)
        return quant.einsum("BTF,FD->BTD", jax.nn.silu(g_btf) * u_btf, self.down,
                            self.down_scale, dt)


class Layer(nnx.Module):
    def __init__(self, config: ModelConfig, *, mesh: Mesh, specs: WeightSpecs, rngs: nnx.Rngs):
        kw = dict(mesh=mesh, specs=specs, param_dtype=config.param_dtype)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.attn = Attention(config, mesh=mesh, specs=specs, rngs=rngs)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.mlp = MLP(config, mesh=mesh, specs=specs, rngs=rngs)


class Transformer(nnx.Module):
    """The decoder. `model(tokens)` maps int32 tokens (B, T) to float32 logits (B, T, V).

    Weights are created directly in their shardings on `mesh` (see `ladder_jax.model.sharding`); the
    same `rngs` seed gives the same global weights on any mesh.
    """

    def __init__(self, config: ModelConfig, *, mesh: Mesh, rngs: nnx.Rngs, fsdp: bool = False):
        specs = WeightSpecs.for_model(config, mesh, fsdp=fsdp)
        if fsdp and config.quantize is not None:
            raise ConfigError(f"quantize={config.quantize!r} is for decoding: FSDP (training) "
                              f"keeps float weights")
        self.config = config
        self.mesh = mesh
        D, V, pd = config.d_model, config.vocab_size, config.param_dtype
        self.embed = _weight(rngs, mesh, (V, D), specs.embed_vd, pd, 0.02, specs.fsdp_data)
        self.layers = nnx.List(
            [Layer(config, mesh=mesh, specs=specs, rngs=rngs) for _ in range(config.n_layers)])
        self.final_norm = RMSNorm(D, config.norm_eps, mesh=mesh, specs=specs, param_dtype=pd)
        self.head, self.head_scale = (None, None) if config.tie_embeddings else _linear(
            rngs, mesh, "head", (D, V), specs.head_dv, config, 0.02, specs.fsdp_data)

    def __repr__(self):
        c = self.config
        ladder = ""
        if c.residual == "ladder" and c.ladder_layers is not None:
            ladder = f", ladder_layers={c.ladder_layers}"
        return (f"Transformer({c.n_layers}L d={c.d_model} heads={c.n_heads}/{c.n_kv_heads} "
                f"ff={c.d_ff} vocab={c.vocab_size}, residual={c.residual!r}{ladder}, "
                f"{f'weights {c.quantize}, ' if c.quantize else ''}"
                f"params={c.num_params() / 1e6:.2f}M, mesh=data:{self.mesh.shape[DATA]} x "
                f"tp:{self.mesh.shape[TP]})")

    __str__ = __repr__

    # -- the sharded entry point -----------------------------------------------------------

    def __call__(self, tokens_bt, positions_bt=None):
        """Logits (B, T, V) float32 for int tokens (B, T); positions default to 0..T-1."""
        return self._sharded(tokens_bt, positions_bt, None)

    def forward_cached(self, tokens_bt, positions_bt, cache):
        """(logits, cache): the forward of `tokens_bt` at `positions_bt` against a KV cache
        (a list of (k, v) per layer: `ladder_jax.inference.cache.KVCache.layers()`), whose
        updated copy is returned. Row b's tokens are written to cache slots positions[b, 0]
        onwards and see the slots before them."""
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
        specs = stored_specs(state)  # the weights enter as stored (FSDP: split over data)
        batch, logits = P(DATA, None), P(DATA, None, TP)

        cache_args = () if cache is None else (cache,)  # the cache travels only if given
        cache_specs = tuple(jax.tree.map(lambda _: sharding.CACHE_BSKH, c) for c in cache_args)

        def local(state, tokens_bt, positions_bt, *cache):
            logits_btv, cache = nnx.merge(graphdef, state).forward_local(
                tokens_bt, positions_bt, *cache)
            return logits_btv if cache is None else (logits_btv, cache)

        return sharding.shard(local, self.mesh, in_specs=(specs, batch, batch, *cache_specs),
                              out_specs=(logits, *cache_specs) if cache_specs else logits)(
            state, tokens_bt, positions_bt, *cache_args)

    # -- inside shard_map ------------------------------------------------------------------

    def forward_local(self, tokens_bt, positions_bt, caches=None):
        """One rank's forward: local batch rows, all of D, its heads / F / V slice. Returns
        (logits, updated caches or None)."""
        c = self.config
        x_btd = sharding.embed_lookup(self.embed, tokens_bt).astype(jnp.float32)
        x_btd, caches = self.layer_loop(x_btd, positions_bt, caches)
        h_btd = self.final_norm(x_btd).astype(c.dtype)
        if self.head is None:
            head_dv = sharding.local_vocab_rows(sharding.read_weight(self.embed),
                                                self.mesh.shape[TP]).T.astype(c.dtype)
        else:
            head_dv = sharding.read_weight(self.head, c.dtype)
        with jax.named_scope("head"):
            if c.residual == "upper_bound":  # the stream is tp-varying already
                logits_btv = jnp.einsum("BTD,DV->BTV", h_btd, head_dv,
                                        preferred_element_type=jnp.float32)
            else:
                logits_btv = residual.lm_head(h_btd, head_dv)
            logits_btv = quant.rescale(logits_btv, "BTD,DV->BTV", None if self.head_scale is None
                                       else sharding.read_weight(self.head_scale, jnp.float32))
        return logits_btv, caches

    def layer_loop(self, x_btd, positions_bt, caches=None):
        """THE layer loop. Parallel is spelled out here; standard, ladder, hybrid and
        upper_bound follow the wiring of `ladder_jax.model.residual`. Returns (x, caches)."""
        c = self.config
        inv_freq = rope_frequencies(c)
        if c.residual != "parallel":
            modules = [pair for layer in self.layers
                       for pair in ((layer.attn_norm, layer.attn), (layer.mlp_norm, layer.mlp))]
            return residual.run(c, modules, x_btd, positions_bt, inv_freq, caches)
        def both(attn, mlp, h_btd):  # one partial sum for the pair: one all-reduce
            return attn(h_btd, positions_bt, inv_freq) + mlp(h_btd)

        if c.remat == "module":
            both = nnx.remat(both)
        new_caches = None if caches is None else []
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer{i}.parallel"):
                h_btd = layer.attn_norm(x_btd).astype(c.dtype)
                if caches is None:
                    y_btd = both(layer.attn, layer.mlp, h_btd)
                else:
                    a_btd, cache = layer.attn(h_btd, positions_bt, inv_freq, caches[i])
                    new_caches.append(cache)
                    y_btd = a_btd + layer.mlp(h_btd)
                x_btd = x_btd + sharding.reduce_tp(y_btd)
        return x_btd, new_caches


def param_specs(state: nnx.State) -> nnx.State:
    """The partition spec of every weight in `state` (a tree of the same structure): how the
    model reads it, split over tp."""
    return jax.tree.map(lambda v: v.spec, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def stored_specs(state: nnx.State) -> nnx.State:
    """Where every weight in `state` is stored: its tp spec, and under FSDP also split over
    data (`Transformer(..., fsdp=True)`, `WeightSpecs.fsdp`)."""
    return jax.tree.map(lambda v: getattr(v, "stored", None) or v.spec, state,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))


def abstract(config: ModelConfig, mesh: Mesh, *, fsdp: bool = False):
    """The model from shapes alone: (graphdef, state) where every weight is a
    `jax.ShapeDtypeStruct` carrying its (stored) `NamedSharding` on `mesh`; nothing is
    allocated. Load or restore weights into that state, then `nnx.merge(graphdef, state)`.
    Raises ShardingError if `config` cannot be split over the mesh."""
    model = nnx.eval_shape(lambda: Transformer(config, mesh=mesh, rngs=nnx.Rngs(0), fsdp=fsdp))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(
        lambda v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
            mesh, getattr(v, "stored", None) or v.spec))),
        state, is_leaf=lambda v: isinstance(v, nnx.Variable))
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
    return clone
