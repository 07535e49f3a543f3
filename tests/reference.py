"""An independent, deliberately plain reference of the model: one device, no shard_map, no NNX.

Written from the spec (the dataflow in ladder_jax.model's docstring), not from its code: RoPE
through complex numbers, grouped-query attention by repeating kv heads, the residual schemes as
explicit pending variables. It reads weights as the nested dict
`nnx.to_pure_dict(nnx.state(model))` gives.
"""

import jax.numpy as jnp
import numpy as np


def _norm(x, scale, eps):
    return x / jnp.sqrt(jnp.mean(x**2, -1, keepdims=True) + eps) * scale


def _inv_freq(cfg, dtype=jnp.float32):
    H = cfg.head_dim
    freqs = np.array([cfg.rope_theta ** (-2.0 * i / H) for i in range(H // 2)])
    sc = cfg.rope_scaling
    if sc is not None:
        out = []
        for f in freqs:
            wavelen = 2 * np.pi / f
            if wavelen < sc.original_max_len / sc.high_freq_factor:
                out.append(f)
            elif wavelen > sc.original_max_len / sc.low_freq_factor:
                out.append(f / sc.factor)
            else:
                s = (sc.original_max_len / wavelen - sc.low_freq_factor) / (
                    sc.high_freq_factor - sc.low_freq_factor
                )
                out.append((1 - s) * f / sc.factor + s * f)
        freqs = np.array(out)
    return jnp.asarray(freqs, dtype)


def _rope(x, pos, inv_freq):  # x: B T heads H ; pairs (i, i + H/2)
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    rot = jnp.exp(1j * pos[:, :, None, None] * inv_freq)
    z = z * rot
    return jnp.concatenate([jnp.real(z), jnp.imag(z)], -1).astype(jnp.result_type(x, jnp.float32))


def _attention(w, x, cfg, inv_freq):
    B, T, _ = x.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32), (B, T))
    q = _rope(jnp.einsum("btd,dnh->btnh", x, w["q"]), pos, inv_freq)
    k = _rope(jnp.einsum("btd,dkh->btkh", x, w["k"]), pos, inv_freq)
    v = jnp.einsum("btd,dkh->btkh", x, w["v"])
    rep = cfg.n_heads // cfg.n_kv_heads
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(cfg.head_dim)
    causal = np.tril(np.ones((T, T), bool))
    s = jnp.where(causal, s, -np.inf)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    o = jnp.einsum("bnqk,bknh->bqnh", p, v)
    return jnp.einsum("btnh,nhd->btd", o, w["o"])


def _mlp(w, x):
    g = x @ w["gate"]
    return (g / (1 + jnp.exp(-g)) * (x @ w["up"])) @ w["down"]


def _plain(tree):
    """The state with each linear layer's {"weight": w} read as w (a `Linear` holds it)."""
    if isinstance(tree, dict):
        return (
            tree["weight"] if set(tree) == {"weight"} else {k: _plain(v) for k, v in tree.items()}
        )
    return [_plain(v) for v in tree] if isinstance(tree, list) else tree


def forward(weights, cfg, tokens):
    """Logits (B, T, V) for `tokens` under cfg.residual / cfg.ladder_layers."""
    weights = _plain(weights)
    eps = cfg.norm_eps
    inv_freq = _inv_freq(cfg)
    x = weights["embed"][tokens]
    L = cfg.n_layers

    def A(i, x):
        lw = weights["layers"][i]
        return _attention(lw["attn"], _norm(x, lw["attn_norm"]["scale"], eps), cfg, inv_freq)

    def M(i, x):
        lw = weights["layers"][i]
        return _mlp(lw["mlp"], _norm(x, lw["mlp_norm"]["scale"], eps))

    if cfg.residual == "parallel":
        for i in range(L):
            lw = weights["layers"][i]
            h = _norm(x, lw["attn_norm"]["scale"], eps)
            x = x + _attention(lw["attn"], h, cfg, inv_freq) + _mlp(lw["mlp"], h)
    else:
        if cfg.residual != "ladder":
            ladder = set()
        elif cfg.ladder_layers is None:
            ladder = set(range(L))
        elif isinstance(cfg.ladder_layers, int):
            ladder = set(range(L - cfg.ladder_layers, L))
        else:
            ladder = set(cfg.ladder_layers)
        pending_a = pending_m = 0.0
        for i in range(L):
            if i in ladder:
                x = x + pending_a
                pending_a = A(i, x)
                x = x + pending_m
                pending_m = M(i, x)
            else:
                x = x + pending_a + pending_m
                pending_a = pending_m = 0.0
                x = x + A(i, x)
                if i + 1 in ladder:  # boundary: the next attention must not see this MLP
                    pending_m = M(i, x)
                else:
                    x = x + M(i, x)
        x = x + pending_a + pending_m
    x = _norm(x, weights["final_norm"]["scale"], eps)
    head = weights["embed"].T if cfg.tie_embeddings else weights["head"]
    return x @ head


def cache_attention(q_btnh, k_bkhs, v_bksh, q_pos_bt):
    """Attention of queries at positions q_pos over a KV cache (keys (B, K, H, S), values
    (B, K, S, H)): query t of row b sees slot s iff s <= q_pos[b, t]. Only the visible slots
    are gathered (numpy, per row and query), so unfilled slots never enter the arithmetic."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_btnh, k_bkhs, v_bksh))
    B, T, N, H = q.shape
    K = k.shape[1]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for t in range(T):
            n = int(q_pos_bt[b][t]) + 1
            for h in range(N):
                kv = h // (N // K)
                s = q[b, t, h] @ k[b, kv, :, :n] / np.sqrt(H)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ v[b, kv, :n]
    return out
