"""The Ladder Transformer: a Llama-style decoder with every residual scheme, in Flax NNX; one
weight tree for all schemes, `__call__` one shard_map over the model's mesh. The layer diagram
and the code map: docs/architecture.md, 'The model' and 'The code'.

    model = Transformer(ModelConfig.from_preset("tiny", residual="ladder"), mesh=mesh,
                        rngs=nnx.Rngs(0))
    logits = nnx.jit(lambda m, t: m(t))(model, tokens)   # (B, T, V) float32, V split on tp"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ladder_jax.config import ConfigError, ModelConfig, check_desync_tp
from ladder_jax.model import decode, desync, layout, quant, residual, sharding
from ladder_jax.model.attention import attend_rotated, attention_kernel, rope_frequencies
from ladder_jax.model.layout import DATA, TP, WeightSpecs
from ladder_jax.model.linear import FusedInput, FusedLinear, FusesInputs, Linear

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

    def __call__(self, x_btd, positions_bt, inv_freq):
        """This rank's partial sum (B, T, D) of the attention output. `positions_bt=None`: the
        tokens are at positions 0..T-1 (a training sequence) and attention runs as one causal
        flash kernel (`attend_causal`); with positions, the reference `attend`. A KV cache is
        the decode step's (`ladder_jax.model.decode`)."""
        x_btd = x_btd.astype(self.dtype)
        q_btnh, k_btkh, v_btkh = (lin(x_btd, self.dtype) for lin in (self.q, self.k, self.v))
        out_btnh, _ = attend_rotated(q_btnh, k_btkh, v_btkh, positions_bt, inv_freq, self.kernel)
        return self.o(out_btnh, self.dtype)


def flat_matmuls(mesh: Mesh) -> bool:
    """Whether the linear layers of a model on `mesh` run as 2-D matmuls (`linear.flat_einsum`):
    on CPU meshes, where XLA compiles that form's backward several times faster. GPU programs
    keep the einsums (what the overlap proofs and the performance model were built on)."""
    return mesh.devices.flat[0].platform == "cpu"


def linear_matmul(mesh: Mesh, config: ModelConfig) -> str:
    """The matmul of the model's linear layers over a few rows (`Linear.matmul`): the config's
    `decode_matmul` on GPU meshes (running or deviceless), XLA's on CPU meshes."""
    return config.decode_matmul if not flat_matmuls(mesh) else "xla"


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

    def __call__(self, x_btd):
        """This rank's partial sum (B, T, D) of the SwiGLU output."""
        x_btd = x_btd.astype(self.dtype)
        g_btf, u_btf = self.gate(x_btd, self.dtype), self.up(x_btd, self.dtype)
        return self.down(jax.nn.silu(g_btf) * u_btf, self.dtype)


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
        config = resolve_desync(config, mesh)
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
        if c.residual == "desync":
            ladder = (
                f", reduce_pattern={c.reduce_pattern or 'every_layer'}, desync_tp={c.desync_tp}"
            )
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
        cache_specs = tuple(layout.cache_specs(c) for c in cache_args)

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
        """THE layer loop: the layers wired by the config's residual scheme. The training form
        (`ladder_jax.model.residual.run`) without a cache, the cached forward
        (`ladder_jax.model.decode.run`) with one or on a decoding clone; desync's streams
        (`ladder_jax.model.desync.run`) either way. Returns (x, caches)."""
        inv_freq = rope_frequencies(self.config)
        if self.config.residual == "desync":
            return desync.run(self.config, self.layers, x_btd, positions_bt, inv_freq, caches)
        if caches is None and not decode.fused(self.layers[0]):
            return residual.run(self.config, self.layers, x_btd, positions_bt, inv_freq), None
        return decode.run(self.config, self.layers, x_btd, positions_bt, inv_freq, caches)


# ---------------------------------------------------------------------------------------------
# Input projections fused for decoding (gpt-fast builds the same layout when it loads a model).
#
# Matmuls that read the same input: q, k, v of every attention module and gate, up of every
# MLP (parallel: all five, from its one normalized input). Left as separate weights, XLA:GPU's
# dot merger turns them into one matmul over a *new* buffer, the weights concatenated, on every
# step: at decode batch sizes that copy reads and writes the weights again. Fusing them once,
# when a model is set up for decoding, gives that one matmul over a weight that is already
# contiguous (and XLA:CPU two matmuls per layer fewer). The weight tree itself is unchanged
# (every tree loads into every scheme and tp size, HF import/export untouched): the fused
# weights live only in the decoding clone, which `ladder_jax.model.decode` runs.


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
    if model.config.residual == "desync":  # its streams read per-stream blocks: not fused
        return clone
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


def resolve_desync(config: ModelConfig, mesh: Mesh) -> ModelConfig:
    """`config` with a desync model's desync_tp fixed: the mesh's tp unless set, refused in one
    line when the mesh's tp does not divide it (each device carries desync_tp / tp streams)."""
    if config.residual != "desync":
        return config
    tp = sharding.tp_size(mesh)
    T = config.desync_tp if config.desync_tp is not None else tp
    if T % tp:
        raise sharding.ShardingError(
            f"desync_tp={T} streams cannot be split over tp={tp} devices: use a tp that divides {T}"
        )
    check_desync_tp(config, T)
    return dataclasses.replace(config, desync_tp=T)


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
    if changes.get("residual", "desync") != "desync":
        changes = {"reduce_pattern": None, "desync_tp": None, **changes}
    config = resolve_desync(dataclasses.replace(model.config, **changes), model.mesh)
    WeightSpecs.for_model(config, model.mesh)
    graphdef, state = nnx.split(model)
    clone = nnx.merge(graphdef, state)
    clone.config = config
    if config.decode_matmul != model.config.decode_matmul:
        for node in quant.linears(clone):
            node.matmul = linear_matmul(model.mesh, config)
    return clone
