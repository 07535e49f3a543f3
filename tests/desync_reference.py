"""A plain float64 reference of Desync Residual: one residual stream per tensor-parallel rank.

Written from the scheme's definition, not from the model's code. Stream r of desync_tp = T owns
the r-th contiguous block of query heads and of MLP hidden units; a module's partial output p_r
is computed from its own stream (shared norm scales). A syncing module sets every stream to
sum_s (p_s + x_s / T) (one all-reduce); a rank-local one adds p_r to x_r. The last layer's MLP
always syncs, so the logits come from any stream. Weights: the nested dict
`nnx.to_pure_dict(nnx.state(model))`, as `tests.reference` reads them; its RMSNorm, RoPE, GQA
attention and SwiGLU are reused, evaluated in float64.
"""

import types

import jax
import numpy as np

from tests import reference

PRESETS = ("every_layer", "every_2_layers", "final_only")


def resolve_pattern(pattern, n_layers):
    """The (attn_sync, mlp_sync) pair of every layer for a preset name or an explicit list."""
    last = n_layers - 1
    if pattern == "every_layer":
        return tuple((False, True) for _ in range(n_layers))
    if pattern == "every_2_layers":
        return tuple((False, layer % 2 == 1 or layer == last) for layer in range(n_layers))
    if pattern == "final_only":
        return tuple((False, layer == last) for layer in range(n_layers))
    if isinstance(pattern, str):
        raise ValueError(f"unknown reduce pattern {pattern!r}: one of {', '.join(PRESETS)}")
    pairs = tuple(tuple(p) for p in pattern)
    if len(pairs) != n_layers or any(
        len(p) != 2 or not all(isinstance(b, bool) for b in p) for p in pairs
    ):
        raise ValueError(f"a reduce pattern is {n_layers} (attn_sync, mlp_sync) pairs of bools")
    if not pairs[last][1]:
        raise ValueError("the last layer's MLP must sync (all streams end equal)")
    return pairs


def _float64(tree):
    if isinstance(tree, dict):
        return {k: _float64(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_float64(v) for v in tree]
    return np.asarray(tree, np.float64)


def _blocks(cfg, T):
    """Per stream: (query heads slice, kv heads slice, MLP units slice)."""
    N, K, F = cfg.n_heads, cfg.n_kv_heads, cfg.d_ff
    if N % T or F % T or (K % T and T % K):
        raise ValueError(f"desync_tp={T} does not divide the heads ({N}, {K} kv) and d_ff {F}")
    rep, n = N // K, N // T
    out = []
    for r in range(T):
        q = slice(r * n, (r + 1) * n)
        kv = slice(q.start // rep, (q.stop - 1) // rep + 1)
        out.append((q, kv, slice(r * F // T, (r + 1) * F // T)))
    return out


def _attn_part(lw, h, cfg, inv_freq, q, kv):
    """Stream-local attention: the query heads q (with their kv heads) through o's rows."""
    w = {k: lw[k][:, kv] for k in ("k", "v")} | {"q": lw["q"][:, q], "o": lw["o"][q]}
    sub = types.SimpleNamespace(
        n_heads=q.stop - q.start, n_kv_heads=kv.stop - kv.start, head_dim=cfg.head_dim
    )
    return reference._attention(w, h, sub, inv_freq)


def _mlp_part(lw, h, units):
    w = {"gate": lw["gate"][:, units], "up": lw["up"][:, units], "down": lw["down"][units]}
    return reference._mlp(w, h)


def forward(weights, cfg, tokens, desync_tp, syncs):
    """float64 logits (B, T, V) of desync_tp streams under `syncs` (resolved pairs)."""
    T, L, eps = desync_tp, cfg.n_layers, cfg.norm_eps
    syncs = resolve_pattern(syncs, L)
    blocks = _blocks(cfg, T)
    with jax.enable_x64(True):
        w = _float64(reference._plain(weights))
        inv_freq = reference._inv_freq(cfg, np.float64)
        xs = [w["embed"][np.asarray(tokens)]] * T
        for i in range(L):
            lw = w["layers"][i]

            def attn(r, x, lw=lw):
                h = reference._norm(x, lw["attn_norm"]["scale"], eps)
                return _attn_part(lw["attn"], h, cfg, inv_freq, *blocks[r][:2])

            def mlp(r, x, lw=lw):
                h = reference._norm(x, lw["mlp_norm"]["scale"], eps)
                return _mlp_part(lw["mlp"], h, blocks[r][2])

            for module, sync in zip((attn, mlp), syncs[i], strict=True):
                parts = [np.asarray(module(r, x)) for r, x in enumerate(xs)]
                if sync:
                    xs = [sum(p + x / T for p, x in zip(parts, xs, strict=True))] * T
                else:
                    xs = [x + p for x, p in zip(xs, parts, strict=True)]
        x = np.asarray(reference._norm(xs[0], w["final_norm"]["scale"], eps))
    head = w["embed"].T if cfg.tie_embeddings else w["head"]
    return x @ head


def forward_config(weights, cfg, tokens):
    """`forward` with desync_tp and the pattern read from a desync ModelConfig."""
    return forward(weights, cfg, tokens, cfg.desync_tp, cfg.desync_syncs())


def greedy(weights, cfg, prompt, steps, desync_tp, syncs):
    """Greedy continuation (B, steps) by re-running the full forward each step."""
    tokens = np.asarray(prompt)
    for _ in range(steps):
        nxt = forward(weights, cfg, tokens, desync_tp, syncs)[:, -1].argmax(-1)
        tokens = np.concatenate([tokens, nxt[:, None]], 1)
    return tokens[:, np.asarray(prompt).shape[1] :]
