"""Desync Residual: T = `config.desync_tp` residual streams that all-reduce only where
`ModelConfig.desync_syncs` says; a tp rank carries T / tp of them, so results depend on T only.
The spec: docs/architecture.md, 'Desync Residual'.

    x_btd, caches = run(config, layers, x_btd, positions_bt, inv_freq, caches)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ladder_jax.model import residual, sharding
from ladder_jax.model.attention import attend_rotated


def run(config, layers, x_btd, positions_bt, inv_freq, caches=None):
    """The streams through `layers` inside shard_map, from the embedded tokens x (B, T, D)
    (tp-invariant); with `caches` (a (k, v) per layer) attention reads and writes them.
    Returns (x after the last sync (B, T, D), tp-invariant; updated caches or None)."""
    S = config.desync_tp // jax.lax.axis_size(sharding.TP)
    x_sbtd = sharding.vary_tp(jnp.broadcast_to(x_btd, (S, *x_btd.shape)))
    caches = None if caches is None else list(caches)
    attention, mlp = _attention, _mlp
    if config.remat != "none":  # each module keeps its input only (or its matmuls' outputs)
        policy = residual.MATMULS if config.remat == "matmuls" else None
        attention, mlp = nnx.remat(_attention, policy=policy), nnx.remat(_mlp, policy=policy)
    synced = None
    for i, (layer, syncs) in enumerate(zip(layers, config.desync_syncs())):
        with jax.named_scope(f"layer{i}.attn"):
            h_sbtd = layer.attn_norm(x_sbtd).astype(config.dtype)
            cache = None if caches is None else caches[i]
            p_sbtd, cache = attention(layer.attn, h_sbtd, positions_bt, inv_freq, cache)
            if caches is not None:
                caches[i] = cache
            x_sbtd, synced = _join(x_sbtd, p_sbtd, syncs[0], config.desync_tp)
        with jax.named_scope(f"layer{i}.mlp"):
            p_sbtd = mlp(layer.mlp, layer.mlp_norm(x_sbtd).astype(config.dtype))
            x_sbtd, synced = _join(x_sbtd, p_sbtd, syncs[1], config.desync_tp)
    return synced, caches


def _join(x_sbtd, p_sbtd, sync: bool, T: int):
    """(streams, the synced stream (B, T, D) or None): a module's outputs joined to their
    streams, rank-local, or through one all-reduce of p + x / T over every stream."""
    if not sync:
        return x_sbtd + p_sbtd, None
    synced_btd = sharding.reduce_tp(jnp.sum(p_sbtd + x_sbtd / T, axis=0))
    return sharding.vary_tp(jnp.broadcast_to(synced_btd, x_sbtd.shape)), synced_btd


def _attention(attn, h_sbtd, positions_bt, inv_freq, cache):
    """Each stream's partial attention output (S, B, T, D) from its own input: its query
    heads, their kv heads, its rows of `o`. The streams' heads run side by side as one
    attention over S * (heads per stream) heads, stream-major, as the cache holds them."""
    S, B, T, _ = h_sbtd.shape
    dtype = attn.dtype
    wq_dnh = attn.q.read(dtype)
    D, n_local, H = wq_dnh.shape
    q = jnp.einsum("SBTD,DSNH->SBTNH", h_sbtd, wq_dnh.reshape(D, S, n_local // S, H))
    k = jnp.einsum("SBTD,DSKH->SBTKH", h_sbtd, stream_kv_heads(attn.k.read(dtype), S))
    v = jnp.einsum("SBTD,DSKH->SBTKH", h_sbtd, stream_kv_heads(attn.v.read(dtype), S))

    def heads(a):  # (S, B, T, n, H) -> (B, T, S * n, H)
        return a.transpose(1, 2, 0, 3, 4).reshape(B, T, -1, H)

    out, cache = attend_rotated(
        heads(q), heads(k), heads(v), positions_bt, inv_freq, attn.kernel, cache
    )
    out_btsnh = out.reshape(B, T, S, n_local // S, H)
    wo_snhd = attn.o.read(dtype).reshape(S, n_local // S, H, D)
    return jnp.einsum("BTSNH,SNHD->SBTD", out_btsnh, wo_snhd), cache


def stream_kv_heads(w_dkh, S: int):
    """The kv weight of each of S streams (D, S, K_s, H) from this rank's block (D, K_l, H):
    K_l / S heads each where K_l >= S, else stream s uses head s * K_l // S (K < T: several
    streams share a head, each computing it from its own input)."""
    D, K_l, H = w_dkh.shape
    if K_l >= S:
        return w_dkh.reshape(D, S, K_l // S, H)
    idx = [s * K_l // S for s in range(S)]
    return w_dkh[:, idx][:, :, None, :]


def _mlp(mlp, h_sbtd):
    """Each stream's partial SwiGLU output (S, B, T, D) over its block of hidden units."""
    S = h_sbtd.shape[0]
    dtype = mlp.dtype

    def cols(w_df):  # (D, F_l) -> (D, S, F_l / S)
        return w_df.reshape(w_df.shape[0], S, -1)

    g = jnp.einsum("SBTD,DSF->SBTF", h_sbtd, cols(mlp.gate.read(dtype)))
    u = jnp.einsum("SBTD,DSF->SBTF", h_sbtd, cols(mlp.up.read(dtype)))
    w_fd = mlp.down.read(dtype)
    return jnp.einsum("SBTF,SFD->SBTD", jax.nn.silu(g) * u, w_fd.reshape(S, -1, w_fd.shape[1]))
