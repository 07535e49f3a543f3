"""The cached forward of every scheme (prefill or decode step) against a KV cache, with the same
arithmetic in the same order as the training form (`ladder_jax.model.residual`). Its streams:
docs/architecture.md, 'The KV cache layout' ("Where a decode step goes").

    x_btd, caches = run(config, layers, x_btd, positions_bt, inv_freq, caches)"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ladder_jax.model import ragged, residual, sharding
from ladder_jax.model.attention import attend_rotated, idle_positions


def run(config, layers, x_btd, positions_bt, inv_freq, caches):
    """The stream through `layers` inside shard_map, with `caches` (a (k, v) per layer, or
    None for a fused clone's forward without a cache). Returns (x, updated caches or None)."""
    if config.residual == "parallel":
        return _parallel(config, layers, x_btd, positions_bt, inv_freq, caches)
    slots = residual.wiring(config)
    if caches is not None and folds(layers[0]):
        return _folded_stream(config, slots, layers, x_btd, positions_bt, inv_freq, caches)
    return _stream(config, slots, layers, x_btd, positions_bt, inv_freq, caches)


def fused(layer) -> bool:
    """Whether `layer` belongs to a decoding clone (`transformer.fuse_inputs`)."""
    return layer.fused_in is not None or layer.attn.qkv is not None


def folds(layer) -> bool:
    """Whether decoding folds the norms (and, where no all-reduce sits between, the residual
    adds) into `layer`'s matmuls: its linear layers run the Triton kernel
    (`ModelConfig.decode_matmul="pallas"` on a GPU mesh, `ladder_jax.model.matvec`)."""
    return layer.attn.o.matmul == "pallas"


# ---------------------------------------------------------------------------------------------
# The three streams.


def _parallel(config, layers, x_btd, positions_bt, inv_freq, caches):
    """parallel: h = attn_norm(x); x = x + psum(A(h) + M(h)). A decoding clone's layers
    (`Layer.fused_in`) compute all five input projections as one matmul; folding, its prologue
    normalizes the stream after the previous layer's reduced output joins it."""
    new_caches = None if caches is None else []
    pending = None  # folding: the layer's reduced output joins in the next prologue
    dtype = config.dtype
    for i, layer in enumerate(layers):
        with jax.named_scope(f"layer{i}.parallel"):
            cache = None if caches is None else caches[i]
            fused_in = layer.fused_in
            if caches is not None and fused_in is not None and folds(layer):  # kernels
                joins = () if pending is None else (pending,)
                y_btc, stream = _matmul(fused_in, x_btd, dtype, norm=layer.attn_norm, joins=joins)
                x_btd = x_btd if pending is None else stream
                a, cache = _attend_five_way(layer, y_btc, positions_bt, inv_freq, cache)
                new_caches.append(cache)
                pending = sharding.reduce_tp(a + _down_from(layer.mlp, fused_in, y_btc, 3))
                continue
            # tp-varying from here: the backward's input all-reduce (none at tp=1)
            h_btd = sharding.vary_tp(layer.attn_norm(x_btd).astype(dtype))
            if fused_in is not None:  # one matmul for all five
                y_btc = fused_in(h_btd, dtype)
                a, cache = _attend_five_way(layer, y_btc, positions_bt, inv_freq, cache)
                m_btd = _down_from(layer.mlp, fused_in, y_btc, 3)
            else:
                a, cache, _ = _attention(layer.attn, h_btd, positions_bt, inv_freq, cache)
                m_btd = _mlp(layer.mlp, h_btd)[0]
            if cache is not None:
                new_caches.append(cache)
            x_btd = x_btd + sharding.reduce_tp(a + m_btd)
    return (x_btd if pending is None else x_btd + pending), new_caches


def _stream(config, slots, layers, x_btd, positions_bt, inv_freq, caches):
    """The wiring's forward (`residual.wiring`): an immediate module adds the pending reduced
    output before it reads the stream, a deferred one after, its all-reduce in flight
    meanwhile (tied to the module's output)."""
    reduce, vary = residual.reduce_and_vary(config.residual == "upper_bound")
    caches = None if caches is None else list(caches)
    pending = None  # the previous module's all-reduced output, not yet added to x
    for slot in slots:
        layer = layers[slot.layer]
        with jax.named_scope(f"layer{slot.layer}.{slot.name}"):
            if pending is not None and not slot.deferred:
                x_btd, pending = x_btd + pending, None
            if slot.name == "attn":
                h_btd = vary(layer.attn_norm(x_btd).astype(config.dtype))
                cache = None if caches is None else caches[slot.layer]
                y_btd, cache, _ = _attention(layer.attn, h_btd, positions_bt, inv_freq, cache)
                if caches is not None:
                    caches[slot.layer] = cache
            else:
                y_btd = _mlp(layer.mlp, vary(layer.mlp_norm(x_btd).astype(config.dtype)))[0]
            if pending is not None:  # deferred: that all-reduce ran while the module did
                pending, y_btd = sharding.tie(pending, y_btd)
                x_btd = x_btd + pending
            pending = reduce(y_btd)
    return x_btd + pending, caches


def _folded_stream(config, slots, layers, x_btd, positions_bt, inv_freq, caches):
    """`_stream` with its additions moved into kernels. A module normalizes the stream in its
    first matmul's prologue after the outputs still pending join it there (`joins`: the
    kernel writes the joined stream out), so no norm or residual add runs as a kernel of its
    own; where nothing sits between a module's output and the stream (`_adds_in_epilogue`)
    its last matmul adds it in its epilogue instead. A deferred module's pending output joins
    in the next module's prologue (`late`), as `_stream` adds it after the module, with the
    same tie. Where `_holds` says so, an attention module does not write its joined stream:
    the MLP after it joins the same outputs again, then its own, and writes the stream once a
    layer."""
    reduce, _ = residual.reduce_and_vary(config.residual == "upper_bound")
    epilogue = [_adds_in_epilogue(slots, k) for k in range(len(slots))]
    caches = list(caches)
    pending = None  # the previous module's all-reduced output, not yet in x
    late = None  # a deferred module's pending output: joins in the next module's prologue
    held = ()  # outputs joined in the previous module's prologue whose stream it did not write
    for k, slot in enumerate(slots):
        layer = layers[slot.layer]
        with jax.named_scope(f"layer{slot.layer}.{slot.name}"):
            if slot.deferred:
                new, late = late, None
            else:
                if late is not None:  # a deferred module before an immediate one
                    x_btd, late = x_btd + late, None
                new, pending = pending, None
            joins = held + (() if new is None else (new,))
            hold = bool(joins) and _holds(slots, epilogue, k)
            held = joins if hold else ()
            residual_btd = x_btd if not joins and epilogue[k] else None
            fold = dict(norm=None, joins=joins, write=not hold, residual=residual_btd)
            if slot.name == "attn":
                fold["norm"] = layer.attn_norm
                cache = caches[slot.layer]
                y_btd, cache, stream = _attention(
                    layer.attn, x_btd, positions_bt, inv_freq, cache, **fold
                )
                caches[slot.layer] = cache
            else:
                y_btd, stream = _mlp(layer.mlp, x_btd, **dict(fold, norm=layer.mlp_norm))
            x_btd = x_btd if stream is None else stream
            if residual_btd is not None:  # y_btd is the stream now
                x_btd = reduce(y_btd)
                continue
            if pending is not None:  # deferred: that all-reduce ran while the module did
                late, y_btd = sharding.tie(pending, y_btd)
            pending = reduce(y_btd)
    for rest in (*held, late, pending):
        x_btd = x_btd if rest is None else x_btd + rest
    return x_btd, caches


def _adds_in_epilogue(slots, k: int) -> bool:
    """Whether module k's output joins the stream in its last matmul's epilogue: nothing sits
    between the two (tp 1: no all-reduce) and both module k and the next are immediate (a
    deferred module's stream waits for the previous output). upper_bound at tp > 1 joins its
    outputs in prologues like standard (fewer stream bytes at small shards)."""
    if slots[k].deferred or (k + 1 < len(slots) and slots[k + 1].deferred):
        return False
    return jax.lax.axis_size(sharding.TP) == 1


def _holds(slots, epilogue, k: int) -> bool:
    """Whether attention module k, joining outputs to the stream, leaves the joined stream
    unwritten: the MLP after it joins the same outputs in its own prologue before its own
    pending one (the order of `_stream`'s additions), so the stream is written once a layer."""
    return slots[k].name == "attn" and k + 1 < len(slots) and not epilogue[k + 1]


# ---------------------------------------------------------------------------------------------
# One module against the cache: (output, cache, joined stream). `norm`, `joins`, `write` and
# `residual` are the folds of `Linear.small_m`; without them, the training form's arithmetic.


def _attention(attn, x_btd, positions_bt, inv_freq, cache, **fold):
    """This rank's partial sum of the attention output, the cache with this call's keys and
    values written at `positions_bt` (row b's tokens from slot positions[b, 0]; None: 0..T-1,
    the prefill), and the joined stream (folding, else None)."""
    dtype = attn.dtype
    residual_btd = fold.pop("residual", None)
    x_btd = x_btd if fold.get("norm") is not None else x_btd.astype(dtype)
    if attn.qkv is not None:
        y_btc, stream = _matmul(attn.qkv, x_btd, dtype, **fold)
        if _writes_in_kernel(attn, y_btc.shape[1], positions_bt, cache):
            # the fused projection's output as it lies goes to the attention kernel
            out, cache = _attend_rows(attn, y_btc, positions_bt, inv_freq, cache, residual_btd)
            return out, cache, stream
        q_btnh, k_btkh, v_btkh = attn.qkv.split(y_btc)
    else:
        (q_btnh, k_btkh, v_btkh), stream = _separate(attn.input_linears(), x_btd, dtype, **fold)
    out, cache = _attend_and_project(
        attn, q_btnh, k_btkh, v_btkh, positions_bt, inv_freq, cache, residual_btd
    )
    return out, cache, stream


def _attend_and_project(attn, q_btnh, k_btkh, v_btkh, positions_bt, inv_freq, cache, residual):
    """Everything after the q/k/v projections: RoPE, the cache write, attention (flash over
    the call's own keys for a prefill, `ragged.attend_filled` over the filled part of the
    cache for a step), the output projection. Returns (output, cache or None)."""
    B, T, N, H = q_btnh.shape
    if _writes_in_kernel(attn, T, positions_bt, cache):
        # separate q/k/v: the kernel reads them from one buffer (a copy)
        rows = [x.reshape(B, -1, H) for x in (q_btnh, k_btkh, v_btkh)]
        y_btc = jnp.concatenate(rows, axis=1).reshape(B, T, -1)
        return _attend_rows(attn, y_btc, positions_bt, inv_freq, cache, residual)
    out_btnh, cache = attend_rotated(
        q_btnh, k_btkh, v_btkh, positions_bt, inv_freq, attn.kernel, cache
    )
    return _matmul(attn.o, out_btnh, attn.dtype, residual=residual)[0], cache


def _writes_in_kernel(attn, T, positions_bt, cache) -> bool:
    """Whether a step runs RoPE, the cache write and attention as one kernel
    (`ragged.attend_new`): one token per row over a cache, on the Triton kernel."""
    return (
        cache is not None
        and len(cache) == 2  # rows, not pages
        and positions_bt is not None
        and ragged.writes_in_kernel(attn.kernel, T, cache[1])
    )


def _attend_rows(attn, y_btc, positions_bt, inv_freq, cache, residual, n_heads=None):
    """`_attend_and_project` from a projection's output (B, 1, C) that holds the queries, keys
    and values one after another from column 0: `n_heads` query heads (this rank's), or None:
    q/k/v run to the output's end (columns after them, parallel's gate and up, are not read).
    `ragged.attend_new` reads them where the projection wrote them. Returns (output, cache)."""
    B, T, C = y_btc.shape
    H = cache[1].shape[-1]
    N = n_heads if n_heads is not None else C // H - 2 * cache[1].shape[1]
    # an idle row (a negative position) writes at its slot p and attends up to it: the kernel
    # bounds each row by its own position, so it costs that row's filled part only
    positions_bt = idle_positions(positions_bt)
    out_btnh, cache = ragged.attend_new(y_btc.reshape(B, C), 0, N, positions_bt, inv_freq, *cache)
    return _matmul(attn.o, out_btnh, attn.dtype, residual=residual)[0], cache


def _attend_five_way(layer, y_btc, positions_bt, inv_freq, cache):
    """The attention of a parallel layer from its five-way projection's unsplit output (q, k,
    v, gate, up): on the Triton kernel the output as it lies, elsewhere split into q, k, v
    (splitting and concatenating back for the kernel is a copy XLA does not fuse away)."""
    attn = layer.attn
    if _writes_in_kernel(attn, y_btc.shape[1], positions_bt, cache):
        n_heads = layer.fused_in.parts[0][0]  # this rank's query heads
        return _attend_rows(attn, y_btc, positions_bt, inv_freq, cache, None, n_heads)
    q, k, v, _, _ = layer.fused_in.split(y_btc)
    return _attend_and_project(attn, q, k, v, positions_bt, inv_freq, cache, None)


def _mlp(mlp, x_btd, *, norm=None, joins=(), write=True, residual=None):
    """This rank's partial sum of the SwiGLU output and the joined stream (folding, else
    None). On the Triton kernel a fused gate/up writes silu(gate) * up only (`swiglu`), or
    the down projection multiplies them in its prologue (`_down_from`)."""
    dtype = mlp.dtype
    fold = dict(norm=norm, joins=joins, write=write)
    if norm is None:
        x_btd = x_btd.astype(dtype)
    if mlp.gate_up is not None and mlp.down.matmul == "pallas":
        h = _swiglu(mlp.gate_up, x_btd, dtype, **fold)
        if h is not None:  # silu(gate) * up in the gate/up kernel
            h_btf, stream = h
            return _matmul(mlp.down, h_btf, dtype, residual=residual)[0], stream
        gu_btc, stream = _matmul(mlp.gate_up, x_btd, dtype, **fold)  # in the down kernel
        return _down_from(mlp, mlp.gate_up, gu_btc, 0, residual), stream
    if mlp.gate_up is not None:
        y_btc, stream = _matmul(mlp.gate_up, x_btd, dtype, **fold)
        g_btf, u_btf = mlp.gate_up.split(y_btc)
    else:
        (g_btf, u_btf), stream = _separate([mlp.gate, mlp.up], x_btd, dtype, **fold)
    return _matmul(mlp.down, jax.nn.silu(g_btf) * u_btf, dtype, residual=residual)[0], stream


def _swiglu(fused, x_btd, dtype, **fold):
    """(silu(gate) * up (..., F), stream) of a fused (gate, up) pair through the Triton
    kernel, which multiplies both and writes only that; None where it does not take it."""
    if len(fused.parts) != 2 or fused.parts[0] != fused.parts[1] or fused.matmul != "pallas":
        return None
    return fused.small_m(x_btd, dtype, swiglu=True, **fold)


def _down_from(mlp, fused, y_btc, gate: int, residual=None):
    """The down projection of silu(gate) * up, parts `gate` and `gate + 1` of `fused`'s
    unsplit output: multiplied in the Triton kernel's prologue where it runs."""
    if mlp.down.matmul == "pallas":
        out = mlp.down.small_m(y_btc, mlp.dtype, gate_up=fused.offset(gate), residual=residual)
        if out is not None:
            return out[0]
    parts = fused.split(y_btc)
    h_btf = jax.nn.silu(parts[gate]) * parts[gate + 1]
    return _matmul(mlp.down, h_btf, mlp.dtype, residual=residual)[0]


# ---------------------------------------------------------------------------------------------
# One matmul with its folds, on the kernel or in XLA ops.


def _matmul(linear, x, dtype, *, norm=None, joins=(), write=True, residual=None):
    """(y, stream): `linear` over `x`, where `norm` (an `RMSNorm`) normalizes the float32
    stream x after `joins` join it (stream: the joined stream, None without joins or with
    `write=False`) and `residual` is added to y in float32; in the Triton kernel where it
    takes them (`Linear.small_m`), else in XLA ops."""
    if linear.matmul == "pallas":
        out = linear.small_m(x, dtype, norm=norm, joins=joins, write=write, residual=residual)
        if out is not None:
            return out
    stream = _joined(x, joins)
    if norm is not None:
        x = norm(x if stream is None else stream).astype(dtype)
    y = linear.einsum(x, dtype)
    y = y if residual is None else residual + y
    return y, stream if write else None


def _separate(linears, x, dtype, *, norm=None, joins=(), write=True):
    """(each linear's output, stream) of separate projections over one input, `_matmul`'s
    norm and joins applied once before them."""
    stream = _joined(x, joins)
    if norm is not None:
        x = norm(x if stream is None else stream).astype(dtype)
    return tuple(lin(x, dtype) for lin in linears), stream if write else None


def _joined(x, joins):
    """x + each of `joins`, in order, as the kernel adds them (float32); None without joins."""
    if not joins:
        return None
    for j in joins:
        x = x + j
    return x
